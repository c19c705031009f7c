//! Python bindings (`pagedkv._core`), built only with the `python` feature.
//!
//! The boundary is crossed once per call with whole arrays, never per token or block. Inputs
//! are validated in `args`; errors map to the `pagedkv.errors` tree in `errors`.

mod allocator;
mod attention;
mod args;
mod config;
mod errors;
mod linear;
mod linear_gguf;
mod manager;
mod reuse;
mod scheduler;

use pyo3::prelude::*;

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<allocator::PyBlockAllocator>()?;
    m.add_class::<manager::PyKvCacheManager>()?;
    m.add_class::<scheduler::PySchedulerConfig>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<scheduler::PySchedulerOutput>()?;
    m.add_class::<scheduler::PyRequestUpdate>()?;
    m.add_class::<scheduler::PyRequestUpdates>()?;
    m.add_class::<crate::scheduler::SchedulerStats>()?;
    m.add_function(wrap_pyfunction!(attention::paged_decode_attention_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(linear::cpu_linear, m)?)?;
    m.add_function(wrap_pyfunction!(linear::cpu_isa, m)?)?;
    m.add_function(wrap_pyfunction!(linear_gguf::cpu_linear_gguf, m)?)?;
    m.add_function(wrap_pyfunction!(linear_gguf::gguf_linear_isas, m)?)?;
    m.add_function(wrap_pyfunction!(scheduler::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(config::config_fields, m)?)?;
    m.add_function(wrap_pyfunction!(config::check_config_fields, m)?)?;
    m.add_function(wrap_pyfunction!(config::resolve_speculative, m)?)?;
    m.add("MAX_NUM_BLOCKS", crate::block_pool::MAX_NUM_BLOCKS)?;
    m.add("MAX_BLOCK_SIZE", crate::block_pool::MAX_BLOCK_SIZE)?;
    m.add("ERROR_CLASS_NAMES", pyo3::types::PyTuple::new(m.py(), errors::ERROR_CLASS_NAMES)?)?;
    // `RequestUpdates` is a read-only sequence: make isinstance(x, Sequence) say so.
    let sequence = m.py().import("collections.abc")?.getattr("Sequence")?;
    sequence.call_method1("register", (m.getattr("RequestUpdates")?,))?;
    Ok(())
}
