//! Damping: the count a pool is told to run moves toward its target at most
//! a step per period, and down only after the target stayed below the count
//! for the scale-down delay (Kubernetes HPA's stabilization window, kept in
//! O(1) state: the start of the current run of lower targets and the
//! highest target in it).
//!
//! Rules, each step (`target` already within min / max):
//! - target >= count: the run of lower targets ends; count rises to
//!   `min(target, count + up)`.
//! - target < count, when the caller knows how many of the count are
//!   `ready`: the others are still starting, and those the target does not
//!   need are cancelled at once (count falls to `max(target, ready)`: an
//!   endpoint that serves nothing yet costs its start-up for nothing, and
//!   cancelling it takes no capacity away); no step limit, no delay.
//! - target still < count: the run starts (or goes on) and remembers its
//!   highest target; once it has lasted `delay`, count falls to
//!   `max(highest, count - down)`; a run that reaches its highest ends, so
//!   going lower again waits another delay. Ready endpoints always wait.

/// The step limits and the delay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Damping {
    pub scale_down_delay_s: f64,
    pub max_step_up: u64,
    pub max_step_up_percent: f64,
    pub max_step_down: u64,
    pub max_step_down_percent: f64,
}

impl Damping {
    /// The larger of `count` and `percent` of `current`, rounded up.
    fn limit(count: u64, percent: f64, current: u64) -> u64 {
        let share = (percent / 100.0 * current as f64).ceil();
        count.max(share.min(u64::MAX as f64) as u64)
    }

    pub fn up(&self, current: u64) -> u64 {
        Self::limit(self.max_step_up, self.max_step_up_percent, current)
    }

    pub fn down(&self, current: u64) -> u64 {
        Self::limit(self.max_step_down, self.max_step_down_percent, current)
    }
}

/// One pool's damped count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Damper {
    current: u64,
    /// Start of the current run of targets below `current`, and its highest.
    down_since: Option<f64>,
    down_peak: u64,
}

impl Damper {
    /// Starting at `current` endpoints.
    pub fn new(current: u64) -> Self {
        Self {
            current,
            down_since: None,
            down_peak: 0,
        }
    }

    pub fn current(&self) -> u64 {
        self.current
    }

    /// The count at `now` toward `target`; `ready` (None: unknown) is how
    /// many endpoints are ready now, the rest of the count still starting
    /// (a caller may pass more: the count starting ones are cancelled down
    /// to is `max(target, ready)`).
    pub fn step(&mut self, now: f64, target: u64, ready: Option<u64>, d: &Damping) -> u64 {
        if target >= self.current {
            self.down_since = None;
            let up = d.up(self.current);
            self.current = target.min(self.current.saturating_add(up));
            return self.current;
        }
        if let Some(ready) = ready {
            self.current = self.current.min(target.max(ready));
            if target == self.current {
                self.down_since = None;
                return self.current;
            }
            // The run's highest target asked for more than is now counted:
            // what it held was starting.
            self.down_peak = self.down_peak.min(self.current);
        }
        let since = match self.down_since {
            Some(t) => {
                self.down_peak = self.down_peak.max(target);
                t
            }
            None => {
                self.down_since = Some(now);
                self.down_peak = target;
                now
            }
        };
        if now - since >= d.scale_down_delay_s {
            let down = d.down(self.current);
            self.current = self.down_peak.max(self.current.saturating_sub(down));
            if self.current == self.down_peak {
                self.down_since = None;
            }
        }
        self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn by_hand() {
        let d = Damping {
            scale_down_delay_s: 30.0,
            max_step_up: 2,
            max_step_up_percent: 0.0,
            max_step_down: 3,
            max_step_down_percent: 0.0,
        };
        let mut m = Damper::new(1);
        assert_eq!(m.step(0.0, 10, None, &d), 3);
        assert_eq!(m.step(10.0, 10, None, &d), 5);
        assert_eq!(m.step(20.0, 4, None, &d), 5); // run starts
        assert_eq!(m.step(30.0, 1, None, &d), 5);
        assert_eq!(m.step(40.0, 2, None, &d), 5);
        assert_eq!(m.step(50.0, 1, None, &d), 4); // 30 s after the run began: to its highest, 4
        assert_eq!(m.step(60.0, 1, None, &d), 4); // a new run: another delay
        assert_eq!(m.step(90.0, 1, None, &d), 1);
        // Percent limits: 100 % of 10 is 10.
        let p = Damping {
            max_step_up: 1,
            max_step_up_percent: 100.0,
            ..d
        };
        let mut m = Damper::new(10);
        assert_eq!(m.step(0.0, 100, None, &p), 20);
    }

    /// Endpoints still starting that the target no longer needs are
    /// cancelled at once; the ready ones keep the delay.
    #[test]
    fn starting_endpoints_are_cancelled_first_ready_ones_wait() {
        let d = Damping {
            scale_down_delay_s: 30.0,
            max_step_up: 100,
            max_step_up_percent: 0.0,
            max_step_down: 2,
            max_step_down_percent: 0.0,
        };
        // 40 start; 10 s on, the target is 20: 30 of the 40 go at once.
        let mut m = Damper::new(10);
        assert_eq!(m.step(0.0, 50, Some(10), &d), 50);
        assert_eq!(m.step(10.0, 20, Some(10), &d), 20);
        // Below the ready 10: down to them at once, then the delay.
        assert_eq!(m.step(20.0, 4, Some(10), &d), 10);
        assert_eq!(m.step(30.0, 4, Some(10), &d), 10);
        assert_eq!(m.step(49.0, 4, Some(10), &d), 10);
        // 30 s after: down by the step limit.
        assert_eq!(m.step(50.0, 4, Some(10), &d), 8);
        // Unknown readiness: the delay for every endpoint, as before.
        let mut m = Damper::new(10);
        assert_eq!(m.step(0.0, 50, None, &d), 50);
        assert_eq!(m.step(10.0, 20, None, &d), 50);
        assert_eq!(m.step(40.0, 20, None, &d), 48);
        // More ready than counted (the fleet is ahead): nothing cancelled.
        let mut m = Damper::new(10);
        assert_eq!(m.step(0.0, 4, Some(12), &d), 10);
    }

    /// Random targets: never more than the step limit either way, never
    /// down within the delay of the last target at or above the count,
    /// but for starting endpoints (the count above the ready ones), which
    /// fall to the target at once.
    #[test]
    fn steps_and_delay_hold_on_random_targets() {
        let mut rng = Rng::new(11);
        for case in 0..300 {
            let d = Damping {
                scale_down_delay_s: rng.below(100) as f64,
                max_step_up: rng.below(5),
                max_step_up_percent: [0.0, 10.0, 100.0][rng.below(3) as usize],
                max_step_down: 1 + rng.below(5),
                max_step_down_percent: [0.0, 25.0, 50.0][rng.below(3) as usize],
            };
            let mut m = Damper::new(rng.below(50));
            let mut now = 0.0;
            let mut last_not_lower = 0.0;
            for _ in 0..200 {
                now += 1.0 + rng.below(20) as f64;
                let target = rng.below(120);
                let before = m.current();
                let ready = (rng.below(2) == 0).then(|| rng.below(before + 10));
                let after = m.step(now, target, ready, &d);
                // What the delay and the step limit hold: the ready ones.
                let held = ready.map_or(before, |r| before.min(r.max(target)));
                if target >= before {
                    last_not_lower = now;
                    assert!(after >= before && after <= target, "case {case}");
                    assert!(after - before <= d.up(before), "case {case}");
                } else {
                    assert!(after <= held && after >= target, "case {case}");
                    assert!(held - after <= d.down(held), "case {case}");
                    if after < held {
                        assert!(now - last_not_lower >= d.scale_down_delay_s, "case {case}");
                    }
                }
            }
        }
    }
}
