//! The pods a router chooses among: string names at the API, dense indices
//! inside, each with its count of running requests.
//!
//! Shared by the prefix-cache router and the VTC router. Counts are either
//! kept by the router (one more on `start`, one less on `complete`) or set
//! wholesale from telemetry (`set_running`).

use crate::error::{invalid, unknown, Result};
use crate::snapshot::{Reader, Writer};

/// Most pods one router holds.
pub const MAX_PODS: usize = 4096;
/// Longest pod name, in bytes.
pub const MAX_POD_NAME_BYTES: usize = 256;
/// Largest running count accepted from telemetry: more marks corrupt input.
pub const MAX_RUNNING: i64 = 1 << 32;

/// Checks a pod name: 1 to `MAX_POD_NAME_BYTES` bytes.
pub fn check_pod_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_POD_NAME_BYTES {
        return Err(invalid(format!(
            "pod name must be 1 to {MAX_POD_NAME_BYTES} bytes, got {} bytes",
            name.len()
        )));
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodSet {
    names: Vec<String>,
    running: Vec<u64>,
}

impl PodSet {
    /// Pods in the given order; names must be valid and distinct.
    pub fn new<S: AsRef<str>>(names: &[S]) -> Result<Self> {
        let mut pods = Self::default();
        for name in names {
            pods.add(name.as_ref())?;
        }
        Ok(pods)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
    pub fn names(&self) -> &[String] {
        &self.names
    }
    pub fn running(&self) -> &[u64] {
        &self.running
    }

    /// The index of `name` (a linear scan: routers hold tens of pods).
    pub fn index(&self, name: &str) -> Result<usize> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| unknown("pod", name))
    }

    /// Appends a pod with no running requests; returns its index.
    pub fn add(&mut self, name: &str) -> Result<usize> {
        check_pod_name(name)?;
        if self.names.iter().any(|n| n == name) {
            return Err(invalid(format!("pod {name:?} is already present")));
        }
        if self.names.len() >= MAX_PODS {
            return Err(invalid(format!("at most {MAX_PODS} pods")));
        }
        self.names.push(name.to_owned());
        self.running.push(0);
        Ok(self.names.len() - 1)
    }

    /// Removes a pod; the pods after it move down one index.
    pub fn remove(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        self.names.remove(i);
        self.running.remove(i);
        Ok(())
    }

    /// Checks counts for `set_running` without setting them.
    pub fn check_running(&self, counts: &[i64]) -> Result<()> {
        if counts.len() != self.names.len() {
            return Err(invalid(format!(
                "running has {} counts for {} pods",
                counts.len(),
                self.names.len()
            )));
        }
        if let Some(c) = counts.iter().find(|&&c| !(0..=MAX_RUNNING).contains(&c)) {
            return Err(invalid(format!(
                "running counts must be in [0, {MAX_RUNNING}], got {c}"
            )));
        }
        Ok(())
    }

    /// Overwrites every count (one per pod, in pod order) from telemetry.
    pub fn set_running(&mut self, counts: &[i64]) -> Result<()> {
        self.check_running(counts)?;
        for (r, &c) in self.running.iter_mut().zip(counts) {
            *r = c as u64;
        }
        Ok(())
    }

    /// Counts one more request running on pod `i` (an index from this set).
    pub fn start(&mut self, i: usize) {
        self.running[i] = self.running[i].saturating_add(1);
    }

    /// Ends one running request on `name`; refused when none is running.
    pub fn complete(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        match self.running[i].checked_sub(1) {
            Some(n) => {
                self.running[i] = n;
                Ok(())
            }
            None => Err(invalid(format!(
                "complete: pod {name:?} has no running request"
            ))),
        }
    }

    /// The pod with the fewest running requests (the first on ties).
    pub fn least_loaded(&self) -> Option<usize> {
        (0..self.len()).min_by_key(|&i| (self.running[i], i))
    }

    pub fn write(&self, w: &mut Writer) {
        w.u64(self.names.len() as u64);
        for (name, &r) in self.names.iter().zip(&self.running) {
            w.str(name).u64(r);
        }
    }

    pub fn read(r: &mut Reader<'_>) -> Result<Self> {
        let n = r.count(12)?;
        let mut pods = Self::default();
        for _ in 0..n {
            let name = r.str()?;
            let running = r.u64()?;
            // A bad name is reported as a bad snapshot by `snapshot::restore`.
            pods.add(&name)?;
            if let Some(last) = pods.running.last_mut() {
                *last = running;
            }
        }
        Ok(pods)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_counts_and_errors() {
        let mut p = PodSet::new(&["a", "b", "c"]).expect("pods");
        assert_eq!(p.least_loaded(), Some(0));
        p.set_running(&[3, 1, 1]).expect("set");
        assert_eq!(p.least_loaded(), Some(1));
        p.start(1);
        assert_eq!(p.running(), &[3, 2, 1]);
        p.complete("a").expect("complete");
        assert_eq!(p.running(), &[2, 2, 1]);
        assert!(p.set_running(&[1, 2]).is_err());
        assert!(p.set_running(&[1, -2, 0]).is_err());
        assert_eq!(p.running(), &[2, 2, 1]);
        assert!(p.add("a").is_err());
        assert!(p.add("").is_err());
        assert!(p.add(&"x".repeat(257)).is_err());
        assert_eq!(p.complete("zz"), Err(unknown("pod", "zz")));
        p.remove("b").expect("remove");
        assert_eq!(p.names(), &["a".to_owned(), "c".to_owned()]);
        assert_eq!(p.running(), &[2, 1]);
        p.complete("c").expect("complete");
        assert!(p.complete("c").is_err());
        assert_eq!(PodSet::default().least_loaded(), None);

        let mut w = Writer::new(b"TEST", 1);
        p.write(&mut w);
        let bytes = w.finish();
        let mut r = Reader::new(&bytes, b"TEST", 1, "test").expect("header");
        assert_eq!(PodSet::read(&mut r), Ok(p));
        assert!(r.finish().is_ok());
    }
}
