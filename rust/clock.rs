//! The one clock of every default `now`: seconds on a monotonic clock whose
//! epoch is fixed when the process first reads it (`routecore.monotonic()` in
//! Python; the data plane's admission uses it too, so state carried over a
//! reload keeps its times).

use std::sync::OnceLock;
use std::time::Instant;

/// Seconds since this process first read the clock; never decreases.
pub fn monotonic() -> f64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    #[test]
    fn monotonic_never_decreases() {
        let a = super::monotonic();
        let b = super::monotonic();
        assert!(0.0 <= a && a <= b);
    }
}
