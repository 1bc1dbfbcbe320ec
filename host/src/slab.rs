//! [`Slab`]: values under small `u32` ids, the ids of removed values handed out again — how
//! the plugin adapters and the constraint lanes name the matchers and parsers they hold.

pub(crate) struct Slab<T> {
    items: Vec<Option<T>>,
    free: Vec<u32>,
}

impl<T> Slab<T> {
    pub(crate) fn new() -> Self {
        Self {
            items: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Stores `item` under a free id (the last one freed first), else a new one.
    pub(crate) fn insert(&mut self, item: T) -> u32 {
        match self.free.pop() {
            Some(id) => {
                self.items[id as usize] = Some(item);
                id
            }
            None => {
                self.items.push(Some(item));
                (self.items.len() - 1) as u32
            }
        }
    }

    pub(crate) fn get(&self, id: u32) -> Option<&T> {
        self.items.get(id as usize).and_then(Option::as_ref)
    }

    pub(crate) fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        self.items.get_mut(id as usize).and_then(Option::as_mut)
    }

    /// Takes the value out; its id is free again.
    pub(crate) fn remove(&mut self, id: u32) -> Option<T> {
        let item = self.items.get_mut(id as usize)?.take();
        if item.is_some() {
            self.free.push(id);
        }
        item
    }
}

#[cfg(test)]
mod tests {
    use super::Slab;

    #[test]
    fn removed_ids_come_back_and_stale_ids_find_nothing() {
        let mut s = Slab::new();
        let (a, b, c) = (s.insert('a'), s.insert('b'), s.insert('c'));
        assert_eq!((a, b, c), (0, 1, 2));
        assert_eq!(s.remove(b), Some('b'));
        assert_eq!(s.remove(b), None, "removed twice");
        assert_eq!(s.get(b), None);
        assert_eq!(s.insert('d'), b, "the freed id is reused");
        assert_eq!(s.get(b), Some(&'d'));
        assert_eq!(s.insert('e'), 3);
        *s.get_mut(a).unwrap() = 'z';
        assert_eq!(s.get(a), Some(&'z'));
        assert_eq!(s.get(99), None);
    }
}
