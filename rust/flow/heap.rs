//! A binary min-heap of slab indices whose keys and positions live in the
//! slab itself (an intrusive, indexed heap): removal at a known position and
//! re-keying in O(log n), no allocation once the vector has grown.

/// Where a heap reads its members' keys and writes their positions.
pub(super) trait Slots {
    /// The key of member `id`: smaller first, ties by the second part.
    fn key(&self, id: u32) -> (f64, u64);
    fn set_pos(&mut self, id: u32, pos: u32);
}

fn less(a: (f64, u64), b: (f64, u64)) -> bool {
    a.0 < b.0 || (a.0 == b.0 && a.1 < b.1)
}

pub(super) fn push(heap: &mut Vec<u32>, s: &mut impl Slots, id: u32) {
    heap.push(id);
    let at = heap.len() - 1;
    s.set_pos(id, at as u32);
    up(heap, s, at);
}

/// Removes the member at `pos`.
pub(super) fn remove(heap: &mut Vec<u32>, s: &mut impl Slots, pos: usize) {
    let last = heap.len() - 1;
    heap.swap(pos, last);
    heap.pop();
    if pos < heap.len() {
        s.set_pos(heap[pos], pos as u32);
        fix(heap, s, pos);
    }
}

/// Restores the order after the key of the member at `pos` changed.
pub(super) fn fix(heap: &mut [u32], s: &mut impl Slots, pos: usize) {
    if !up(heap, s, pos) {
        down(heap, s, pos);
    }
}

fn up(heap: &mut [u32], s: &mut impl Slots, mut at: usize) -> bool {
    let moved = at;
    while at > 0 {
        let parent = (at - 1) / 2;
        if !less(s.key(heap[at]), s.key(heap[parent])) {
            break;
        }
        heap.swap(at, parent);
        s.set_pos(heap[at], at as u32);
        at = parent;
    }
    s.set_pos(heap[at], at as u32);
    at != moved
}

fn down(heap: &mut [u32], s: &mut impl Slots, mut at: usize) {
    loop {
        let (l, r) = (2 * at + 1, 2 * at + 2);
        let mut min = at;
        if l < heap.len() && less(s.key(heap[l]), s.key(heap[min])) {
            min = l;
        }
        if r < heap.len() && less(s.key(heap[r]), s.key(heap[min])) {
            min = r;
        }
        if min == at {
            break;
        }
        heap.swap(at, min);
        s.set_pos(heap[at], at as u32);
        at = min;
    }
    s.set_pos(heap[at], at as u32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    struct Keys {
        key: Vec<(f64, u64)>,
        pos: Vec<u32>,
    }

    impl Slots for Keys {
        fn key(&self, id: u32) -> (f64, u64) {
            self.key[id as usize]
        }
        fn set_pos(&mut self, id: u32, pos: u32) {
            self.pos[id as usize] = pos;
        }
    }

    #[test]
    fn pops_in_key_order_with_removals_and_rekeys() {
        let mut rng = Rng::new(7);
        let n = 500;
        let mut s = Keys {
            key: (0..n).map(|i| ((rng.below(50)) as f64, i as u64)).collect(),
            pos: vec![u32::MAX; n],
        };
        let mut heap = Vec::new();
        for id in 0..n as u32 {
            push(&mut heap, &mut s, id);
        }
        // Remove a hundred members from anywhere; re-key a hundred others.
        let mut gone = vec![false; n];
        for _ in 0..100 {
            let id = rng.below(n as u64) as usize;
            if !gone[id] {
                let at = s.pos[id] as usize;
                remove(&mut heap, &mut s, at);
                gone[id] = true;
            }
            let other = rng.below(n as u64) as usize;
            if !gone[other] {
                s.key[other].0 = rng.below(50) as f64;
                let at = s.pos[other] as usize;
                fix(&mut heap, &mut s, at);
            }
        }
        for (at, &id) in heap.iter().enumerate() {
            assert_eq!(s.pos[id as usize] as usize, at);
        }
        let mut out = Vec::new();
        while !heap.is_empty() {
            out.push(s.key[heap[0] as usize]);
            remove(&mut heap, &mut s, 0);
        }
        assert_eq!(out.len(), gone.iter().filter(|g| !**g).count());
        assert!(out.windows(2).all(|w| !less(w[1], w[0])), "{out:?}");
    }
}
