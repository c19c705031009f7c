//! A slab with generation-checked keys: O(1) insert, lookup and removal, slots reused, and a
//! key that outlives its entry is recognised as stale instead of aliasing the slot's next
//! occupant.

/// Generations wrap within 31 bits, so a packed (generation, slot) key is a non-negative i64.
pub const GENERATION_MASK: u32 = 0x7FFF_FFFF;

#[derive(Debug, Clone)]
struct Entry<T> {
    generation: u32,
    value: Option<T>,
}

/// Key of a slab entry: slot index and the slot's generation at insertion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlabKey {
    /// Slot index.
    pub slot: u32,
    /// Generation of the slot when the entry was inserted.
    pub generation: u32,
}

/// Generation-checked slab (see the module docs).
#[derive(Debug, Clone)]
pub struct Slab<T> {
    entries: Vec<Entry<T>>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { entries: Vec::new(), free: Vec::new(), len: 0 }
    }
}

impl<T> Slab<T> {
    /// Number of live entries.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no entry is live.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Stores `value`, returning its key.
    pub fn insert(&mut self, value: T) -> SlabKey {
        self.len += 1;
        if let Some(slot) = self.free.pop() {
            let e = &mut self.entries[slot as usize];
            e.value = Some(value);
            SlabKey { slot, generation: e.generation }
        } else {
            self.entries.push(Entry { generation: 0, value: Some(value) });
            SlabKey { slot: (self.entries.len() - 1) as u32, generation: 0 }
        }
    }

    /// The live entry under `key`.
    #[inline]
    pub fn get(&self, key: SlabKey) -> Option<&T> {
        match self.entries.get(key.slot as usize) {
            Some(Entry { generation, value: Some(v) }) if *generation == key.generation => Some(v),
            _ => None,
        }
    }

    /// The live entry under `key`, mutably.
    #[inline]
    pub fn get_mut(&mut self, key: SlabKey) -> Option<&mut T> {
        match self.entries.get_mut(key.slot as usize) {
            Some(Entry { generation, value: Some(v) }) if *generation == key.generation => Some(v),
            _ => None,
        }
    }

    /// Removes and returns the live entry under `key`; its slot's generation moves on.
    pub fn remove(&mut self, key: SlabKey) -> Option<T> {
        let e = self.entries.get_mut(key.slot as usize)?;
        if e.generation != key.generation || e.value.is_none() {
            return None;
        }
        let v = e.value.take();
        e.generation = e.generation.wrapping_add(1) & GENERATION_MASK;
        self.free.push(key.slot);
        self.len -= 1;
        v
    }

    /// Live entries with their keys, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (SlabKey, &T)> + '_ {
        self.entries.iter().enumerate().filter_map(|(i, e)| {
            e.value.as_ref().map(|v| (SlabKey { slot: i as u32, generation: e.generation }, v))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_keys_miss() {
        let mut s = Slab::default();
        let a = s.insert("a");
        assert_eq!(s.get(a), Some(&"a"));
        assert_eq!(s.remove(a), Some("a"));
        assert_eq!(s.remove(a), None);
        let b = s.insert("b");
        assert_eq!(b.slot, a.slot);
        assert_eq!(s.get(a), None);
        assert_eq!(s.get(b), Some(&"b"));
        assert_eq!(s.len(), 1);
        assert_eq!(s.iter().count(), 1);
    }
}
