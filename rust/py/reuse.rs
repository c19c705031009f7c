//! Python objects of a step (numpy arrays, id lists) reused by later steps.
//!
//! Creating a dozen numpy arrays, two 256-string lists and a 256 x W block table every step
//! costs more than the scheduling itself (allocation, page faults on fresh memory, object
//! churn that triggers the garbage collector). So each field keeps a small ring of buffers and
//! hands one out again once *nothing else references it*.
//!
//! An array buffer is a 1-D numpy array that owns its data, with spare capacity; the step gets a
//! C-contiguous view of it with the step's shape (the view is kept and handed out again while
//! the shape stays the same). numpy views, `torch.from_numpy` tensors, memoryviews and the
//! `SchedulerOutput` itself all hold a reference to the view or to the buffer (a view's base is
//! the buffer, which owns its data), so a buffer is free only when the view's and the buffer's
//! reference counts are the ring's own. A list is free when only the ring references it.
//!
//! The contract for callers: a step's arrays and lists never change while anything references
//! them; they are read-only (a caller that writes into one and drops it may see the write again
//! in a later step's block tables, which are updated row by row).
//!
//! With the usual loop (`out = schedule(); ...; update(out, ...)`) the previous output is still
//! referenced while the next one is built, so rings of three keep reuse going even when a
//! caller holds one extra step.

use numpy::ndarray::{ArrayView, Dimension, Ix1, Ix2};
use numpy::npyffi::{self, flags::NPY_ARRAY_WRITEABLE};
use numpy::{Element, PyArray, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

use crate::error::CoreError;
use crate::scheduler::{BlockTableRows, Scheduler, StepOutput};

/// Buffers kept per field.
const RING: usize = 3;

/// Empty lists kept: a step hands out three, and the previous step may still hold three.
const EMPTY_LISTS: usize = 8;

/// The reference count of `obj`.
#[inline]
fn refcnt<T>(_py: Python<'_>, obj: &Py<T>) -> isize {
    // SAFETY: a valid object pointer, with the GIL held.
    unsafe { ffi::Py_REFCNT(obj.as_ptr()) }
}

/// True when array `a`'s writeable flag is set.
fn writeable<T: Element, D: Dimension>(py: Python<'_>, a: &Py<PyArray<T, D>>) -> bool {
    // SAFETY: a valid array object, with the GIL held.
    unsafe { (*npyffi::_PyArray_GET_ITEM_DATA(a.bind(py).as_array_ptr())).flags & NPY_ARRAY_WRITEABLE != 0 }
}

/// A ring of up to `cap` items: `keep` overwrites the oldest once full.
struct Ring<T> {
    slots: Vec<T>,
    next: usize,
    cap: usize,
}

impl<T> Default for Ring<T> {
    fn default() -> Self {
        Ring { slots: Vec::new(), next: 0, cap: RING }
    }
}

impl<T> Ring<T> {
    /// Stores `item`, replacing the oldest stored one once full; returns its slot.
    fn keep(&mut self, item: T) -> usize {
        if self.slots.len() < self.cap {
            self.slots.push(item);
            return self.slots.len() - 1;
        }
        let i = self.next;
        self.next = (self.next + 1) % self.cap;
        self.slots[i] = item;
        i
    }
}

/// A data buffer (a 1-D numpy array owning `capacity` elements) and the view of it handed out.
struct Buffer<T: Element, D: Dimension> {
    base: Py<PyArray1<T>>,
    view: Option<Py<PyArray<T, D>>>,
}

impl<T: Element, D: Dimension> Buffer<T, D> {
    /// A buffer of `capacity` uninitialized elements (every element handed out is written first).
    fn new(py: Python<'_>, capacity: usize) -> Self {
        // SAFETY: elements are written before any view shows them.
        let base = unsafe { PyArray1::<T>::new(py, Ix1(capacity), false) }.unbind();
        Buffer { base, view: None }
    }

    /// True when nothing but this buffer references the array and its view.
    fn is_free(&self, py: Python<'_>) -> bool {
        match &self.view {
            None => refcnt(py, &self.base) == 1,
            Some(v) => refcnt(py, v) == 1 && refcnt(py, &self.base) == 2,
        }
    }

    fn capacity(&self, py: Python<'_>) -> usize {
        self.base.bind(py).len()
    }

    /// The first `len` elements, to be written.
    ///
    /// # Safety
    /// The buffer must be free (or new) and stay so while the slice lives (GIL held).
    #[allow(clippy::mut_from_ref)]
    unsafe fn data_mut<'a>(&'a self, py: Python<'a>, len: usize) -> PyResult<&'a mut [T]> {
        let all = unsafe { self.base.bind(py).as_slice_mut() }
            .map_err(|e| PyErr::from(CoreError::InvariantViolation(format!("step buffer: {e}"))))?;
        Ok(&mut all[..len])
    }

    /// A C-contiguous view of shape `dims` over the first elements (the cached view when it
    /// has that shape and is still writeable).
    fn view(&mut self, py: Python<'_>, dims: D) -> Py<PyArray<T, D>> {
        if let Some(v) = &self.view {
            if v.bind(py).shape() == dims.slice() && writeable(py, v) {
                return v.clone_ref(py);
            }
        }
        self.view = None;
        let base = self.base.bind(py);
        let ptr = base.data().cast_const();
        // SAFETY: dims.size() <= capacity (checked by the callers), the data lives as long as
        // `base`, which the view holds as its base object.
        let v = unsafe {
            let nd = ArrayView::<T, D>::from_shape_ptr(dims, ptr);
            PyArray::<T, D>::borrow_from_array(&nd, base.clone().into_any())
        }
        .unbind();
        self.view = Some(v.clone_ref(py));
        v
    }
}

/// Buffers of one field, each with a tag saying what its data holds.
struct BufferRing<T: Element, D: Dimension, Tag> {
    ring: Ring<(Buffer<T, D>, Tag)>,
}

impl<T: Element, D: Dimension, Tag: Default> Default for BufferRing<T, D, Tag> {
    fn default() -> Self {
        BufferRing { ring: Ring::default() }
    }
}

impl<T: Element, D: Dimension, Tag: Default> BufferRing<T, D, Tag> {
    /// A free buffer for `dims` (one whose view has that shape first, then any large enough),
    /// else a new one of `capacity` (>= dims.size()) with a default tag.
    fn pick(&mut self, py: Python<'_>, dims: &D, capacity: usize) -> usize {
        let size = dims.size();
        let slots = &self.ring.slots;
        let same_shape = slots.iter().position(|(b, _)| {
            b.is_free(py) && b.view.as_ref().is_some_and(|v| v.bind(py).shape() == dims.slice())
        });
        let found = same_shape.or_else(|| slots.iter().position(|(b, _)| b.is_free(py) && b.capacity(py) >= size));
        match found {
            Some(i) => i,
            None => self.ring.keep((Buffer::new(py, capacity.max(size)), Tag::default())),
        }
    }
}

/// Room for a 1-D field of `n` elements, with slack so that slowly growing sizes reuse it.
fn grow(n: usize) -> usize {
    n + n / 4 + 64
}

/// Reused numpy arrays of one field (copied in from a Rust slice).
pub(crate) struct ArrayRing<T: Element, D: Dimension> {
    buffers: BufferRing<T, D, ()>,
}

impl<T: Element, D: Dimension> Default for ArrayRing<T, D> {
    fn default() -> Self {
        ArrayRing { buffers: BufferRing::default() }
    }
}

impl<T: Element + Copy, D: Dimension> ArrayRing<T, D> {
    /// An array of shape `dims` holding `data` (row-major).
    pub(crate) fn fill(&mut self, py: Python<'_>, dims: D, data: &[T]) -> PyResult<Py<PyArray<T, D>>> {
        debug_assert_eq!(dims.size(), data.len());
        let i = self.buffers.pick(py, &dims, grow(data.len()));
        let (buf, _) = &mut self.buffers.ring.slots[i];
        // SAFETY: the buffer is free or new; only this function touches its data.
        unsafe { buf.data_mut(py, data.len()) }?.copy_from_slice(data);
        Ok(buf.view(py, dims))
    }
}

/// Reused `[rows, width]` int32 block-table arrays; each buffer remembers what its rows hold,
/// so a step writes only the rows that changed (while the width stays the same).
#[derive(Default)]
pub(crate) struct TableRing {
    buffers: BufferRing<i32, Ix2, BlockTableRows>,
}

impl TableRing {
    /// The block tables of `out` (just scheduled by `sched`).
    pub(crate) fn fill(&mut self, py: Python<'_>, sched: &Scheduler, out: &StepOutput) -> PyResult<Py<PyArray<i32, Ix2>>> {
        // One table per row and KV cache group: `[C * B, W]`, group-major (StepOutput::block_tables).
        let (rows, width) = (out.num_kv_groups * out.num_rows(), out.block_table_width);
        let cfg = sched.config();
        // Room for every row the step can have, and for the width to grow a while (up to the
        // widest table max_model_len allows).
        let max_width = cfg.max_model_len.div_ceil(cfg.block_size).max(width);
        let capacity = rows.max(cfg.max_num_seqs * out.num_kv_groups) * (width + width / 4 + 8).min(max_width);
        let dims = Ix2(rows, width);
        let i = self.buffers.pick(py, &dims, capacity);
        let (buf, tags) = &mut self.buffers.ring.slots[i];
        // SAFETY: the buffer is free or new; only this function touches its data.
        let dst = unsafe { buf.data_mut(py, rows * width) }?;
        if let Err(e) = sched.write_block_tables(out, dst, tags) {
            tags.clear();
            return Err(e.into());
        }
        Ok(buf.view(py, dims))
    }
}

/// Reused lists of strings (request ids).
#[derive(Default)]
pub(crate) struct ListRing {
    ring: Ring<Py<PyList>>,
}

/// Reused empty lists.
pub(crate) struct EmptyLists(ListRing);

impl Default for EmptyLists {
    fn default() -> Self {
        EmptyLists(ListRing { ring: Ring { slots: Vec::new(), next: 0, cap: EMPTY_LISTS } })
    }
}

impl EmptyLists {
    /// An empty list (a free one if any).
    pub(crate) fn get(&mut self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.0.fill(py, std::iter::empty())
    }
}

impl ListRing {
    /// A list holding `items` (the very string objects): a free list whose items already are
    /// those objects costs no allocation and no reference-count traffic; a free list of the
    /// same length is patched where it differs.
    pub(crate) fn fill<'a>(&mut self, py: Python<'_>, items: impl ExactSizeIterator<Item = &'a Py<PyString>>) -> PyResult<Py<PyList>> {
        let n = items.len();
        let reuse = self.ring.slots.iter().find(|l| refcnt(py, l) == 1 && l.bind(py).len() == n);
        let Some(list) = reuse else {
            let list = PyList::new(py, items.map(|s| s.clone_ref(py)))?.unbind();
            self.ring.keep(list.clone_ref(py));
            return Ok(list);
        };
        let l = list.bind(py);
        for (i, s) in items.enumerate() {
            // SAFETY: i < n == len(l), GIL held; the borrowed item is only compared.
            let cur = unsafe { ffi::PyList_GetItem(l.as_ptr(), i as ffi::Py_ssize_t) };
            if cur != s.as_ptr() {
                l.set_item(i, s.clone_ref(py))?;
            }
        }
        Ok(list.clone_ref(py))
    }
}
