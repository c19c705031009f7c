//! pagedkv: paged KV-cache management for LLM serving.
//!
//! The KV cache is cut into fixed-size blocks. Each sequence owns a block table (logical block
//! → physical block); blocks are allocated as a sequence grows and return to a free pool when
//! it ends; blocks are shared by reference count (prefix caching, parallel sampling) and copied
//! on write; freed cached blocks are evicted lazily, lowest retention priority first and LRU
//! within a priority. A host tier and a disk tier below the device pool keep swapped-out
//! sequences and evicted cached blocks (see [`kv_cache_manager`]).
//!
//! Modules, bottom up:
//! - [`ids`]: `BlockId`, `SeqId` newtypes.
//! - [`error`]: the crate's one error enum.
//! - [`eviction_queue`]: the free-block queue: uncached blocks first, then cached ones by
//!   retention priority and LRU.
//! - [`block_hash`]: chained 128-bit block hashes, their 64-bit index keys, cache salts.
//! - [`token_store`]: token ids of cached blocks, for verifying hits.
//! - [`kv_events`]: KV-cache events (blocks stored / removed / all cleared) for KV-aware
//!   routers, coalesced per step and encoded in vLLM's msgpack wire format.
//! - [`block_pool`]: ref counts, free queue, prefix-cache index with verified lookups (and,
//!   when asked, a log of its cache changes as [`kv_events`]).
//! - [`block_table`]: logical → physical mapping and slot computation.
//! - [`attention_span`]: what a KV cache group's layers see (full, sliding window, chunked
//!   local), and so which blocks a sequence can give back.
//! - [`slab`]: generation-checked slab (sequence and request storage).
//! - [`thread_pool`]: the worker threads of the CPU kernels (they spin between a step's kernel
//!   calls; rebuilt after a fork).
//! - [`kv_cache_manager`]: sequences over the pool: prefix hits, slots, copy-on-write, fork;
//!   its [`kv_cache_manager::tier_ledger`] keeps the host and disk tiers and the step's copies
//!   between tiers.
//! - [`cpu_attention`]: paged decode attention on the CPU, straight from the block cache.
//! - [`cpu_isa`]: which x86 instruction sets the CPU has (detected once) and the path each CPU
//!   kernel takes.
//! - [`cpu_linear`]: linear layers on the CPU for a decode step's few rows (float32, int8 or
//!   bfloat16 weights), summed in an order that does not depend on the batch.
//! - [`cpu_linear_gguf`]: linear layers on the CPU straight from GGUF block-quantized weights
//!   (Q4_0, Q4_1, Q8_0, Q4_K), per instruction set (AVX-512, AVX2, portable).
//! - [`speculative`]: speculative decoding: the n-gram proposer, the cost model that decides how
//!   many drafts a step verifies, and the verification rule.
//! - [`scheduler`]: continuous batching: token budget, chunked prefill, prefix-cache
//!   admission, preemption, stops, and the flat step output.
//!
//! The Python bindings live in `py` behind the `python` feature.

#![deny(missing_docs)]

pub mod attention_span;
pub mod block_hash;
pub mod block_pool;
pub mod block_table;
pub mod cpu_attention;
pub mod cpu_isa;
pub mod cpu_linear;
pub mod cpu_linear_gguf;
pub mod error;
pub mod eviction_queue;
pub mod ids;
pub mod kv_cache_manager;
pub mod kv_events;
pub mod scheduler;
pub mod slab;
pub mod speculative;
pub mod thread_pool;
pub mod token_store;

#[cfg(feature = "python")]
mod py;

pub use attention_span::AttentionSpan;
pub use block_hash::{BlockHash, ExtraKey, HashMode};
pub use block_pool::BlockPool;
pub use error::{CoreError, Result};
pub use ids::{BlockId, SeqId};
pub use kv_cache_manager::{KvCacheManager, PrefixMatch};
