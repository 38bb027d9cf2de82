//! The step order of one request, in one place (after llm-d's director):
//!
//! route (the pool) -> admit -> queue -> pick (the endpoint) -> lease.
//!
//! Each front end implements [`Steps`] over its own parts (the data plane:
//! `serve::dispatch`; the simulator and tests: the pure parts directly) and
//! calls [`dispatch`], which runs the steps in this order and, when a step
//! refuses, fails or the caller drops the request while a step waits, undoes
//! what the steps before it took, in reverse, exactly once. Nothing a
//! refused request touched stays changed: the pick, the only step whose
//! plugins learn (prefix blocks recorded, session bound, VTC charged), runs
//! only once admission said yes, and a request the pick refuses gets its
//! admission and its pool count back.
//!
//! The queue's place is [`Steps::queue`]: between admission and the pick,
//! it says "dispatch now" today. Flow control fills it (a `flow::FlowQueue`
//! holding the admitted request until its pool has room).

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

/// The steps of one request, as one front end runs them. `Refused` is what
/// a step answers instead of going on (a status and reason, or an error);
/// each `un*` gives back what its step took, and never fails (a front end
/// logs what it cannot give back).
pub trait Steps {
    /// The pool chosen, counted in it (the token-budget router's count).
    type Pool;
    /// What admission holds for the request (its ticket, when accounted).
    type Admitted;
    /// The endpoint chosen, started there (counted in flight, the plugins
    /// told).
    type Picked;
    type Refused;

    /// Chooses the pool and counts the request in it.
    fn route(&mut self) -> Result<Self::Pool, Self::Refused>;
    /// Admits the request into its pool (saturation, quotas); may wait (a
    /// remote admission backend).
    fn admit(
        &mut self,
        pool: &Self::Pool,
    ) -> impl Future<Output = Result<Self::Admitted, Self::Refused>>;
    /// The queue's place, after admission and before the pick: flow control
    /// holds the request here until its pool has room (refusing it on
    /// expiry or displacement). Today every request is dispatched at once.
    fn queue(
        &mut self,
        _pool: &Self::Pool,
        _admitted: &Self::Admitted,
    ) -> impl Future<Output = Result<(), Self::Refused>> {
        std::future::ready(Ok(()))
    }
    /// Chooses the endpoint inside the pool and starts the request there.
    fn pick(
        &mut self,
        pool: &Self::Pool,
        admitted: &Self::Admitted,
    ) -> Result<Self::Picked, Self::Refused>;
    /// Gives back what `admit` took (the request never reached an endpoint).
    fn unadmit(&mut self, pool: &Self::Pool, admitted: Self::Admitted);
    /// Gives back what `route` took.
    fn unroute(&mut self, pool: Self::Pool);
}

/// A request through every step: what the lease holds until it ends.
#[derive(Debug)]
pub struct Dispatched<S: Steps> {
    pub pool: S::Pool,
    pub admitted: S::Admitted,
    pub picked: S::Picked,
}

/// What the steps took so far, given back in reverse when dropped armed (a
/// refusal, an error, a panic, or the caller dropping the future).
struct Taken<'a, S: Steps> {
    steps: &'a mut S,
    pool: Option<S::Pool>,
    admitted: Option<S::Admitted>,
}

impl<S: Steps> Drop for Taken<'_, S> {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            if let Some(admitted) = self.admitted.take() {
                self.steps.unadmit(&pool, admitted);
            }
            self.steps.unroute(pool);
        }
    }
}

/// Runs `steps` in the order route -> admit -> queue -> pick; on a refusal
/// at any step, what the earlier steps took is given back and the refusal
/// returned.
pub async fn dispatch<S: Steps>(steps: &mut S) -> Result<Dispatched<S>, S::Refused> {
    let pool = steps.route()?;
    let mut taken = Taken {
        steps,
        pool: Some(pool),
        admitted: None,
    };
    // `taken.pool` is Some until the end: the borrows below read it in place.
    let Some(pool) = taken.pool.as_ref() else {
        unreachable!("set above")
    };
    let admitted = taken.steps.admit(pool).await?;
    let admitted = taken.admitted.insert(admitted);
    taken.steps.queue(pool, admitted).await?;
    let picked = taken.steps.pick(pool, admitted)?;
    let (Some(pool), Some(admitted)) = (taken.pool.take(), taken.admitted.take()) else {
        unreachable!("set above")
    };
    Ok(Dispatched {
        pool,
        admitted,
        picked,
    })
}

/// [`dispatch`] for front ends whose steps never wait (the simulator, the
/// pure parts in tests): None, with everything given back, when a step did
/// wait.
pub fn dispatch_now<S: Steps>(steps: &mut S) -> Option<Result<Dispatched<S>, S::Refused>> {
    let mut future = pin!(dispatch(steps));
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(r) => Some(r),
        Poll::Pending => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps that log what they do and refuse at a chosen step.
    #[derive(Default)]
    struct Log {
        refuse_at: Option<&'static str>,
        wait_in_queue: bool,
        log: Vec<&'static str>,
    }

    impl Log {
        fn step(&mut self, name: &'static str) -> Result<u32, &'static str> {
            self.log.push(name);
            if self.refuse_at == Some(name) {
                return Err(name);
            }
            Ok(self.log.len() as u32)
        }
    }

    impl Steps for Log {
        type Pool = u32;
        type Admitted = u32;
        type Picked = u32;
        type Refused = &'static str;
        fn route(&mut self) -> Result<u32, &'static str> {
            self.step("route")
        }
        fn admit(&mut self, _: &u32) -> impl Future<Output = Result<u32, &'static str>> {
            std::future::ready(self.step("admit"))
        }
        fn queue(&mut self, _: &u32, _: &u32) -> impl Future<Output = Result<(), &'static str>> {
            let r = self.step("queue").map(|_| ());
            let wait = self.wait_in_queue;
            async move {
                if wait {
                    std::future::pending::<()>().await;
                }
                r
            }
        }
        fn pick(&mut self, _: &u32, _: &u32) -> Result<u32, &'static str> {
            self.step("pick")
        }
        fn unadmit(&mut self, _: &u32, _: u32) {
            self.log.push("unadmit");
        }
        fn unroute(&mut self, _: u32) {
            self.log.push("unroute");
        }
    }

    fn run(
        refuse_at: Option<&'static str>,
        wait_in_queue: bool,
    ) -> (Option<bool>, Vec<&'static str>) {
        let mut steps = Log {
            refuse_at,
            wait_in_queue,
            log: Vec::new(),
        };
        let r = dispatch_now(&mut steps).map(|r| r.is_ok());
        (r, steps.log)
    }

    #[test]
    fn steps_run_in_order_and_a_refusal_gives_back_the_earlier_ones_in_reverse() {
        let ok = ["route", "admit", "queue", "pick"];
        assert_eq!(run(None, false), (Some(true), ok.to_vec()));
        assert_eq!(run(Some("route"), false), (Some(false), vec!["route"]));
        assert_eq!(
            run(Some("admit"), false),
            (Some(false), vec!["route", "admit", "unroute"])
        );
        for at in ["queue", "pick"] {
            let (r, log) = run(Some(at), false);
            assert_eq!(r, Some(false));
            let upto = ok.iter().position(|&s| s == at).expect("a step") + 1;
            let mut want = ok[..upto].to_vec();
            want.extend(["unadmit", "unroute"]);
            assert_eq!(log, want, "refused at {at}");
        }
    }

    #[test]
    fn a_request_dropped_while_a_step_waits_gives_everything_back_once() {
        assert_eq!(
            run(None, true),
            (None, vec!["route", "admit", "queue", "unadmit", "unroute"])
        );
    }

    #[test]
    fn a_success_is_given_back_by_its_lease_not_here() {
        let mut steps = Log::default();
        let d = dispatch_now(&mut steps)
            .expect("ready")
            .expect("dispatched");
        assert_eq!((d.pool, d.admitted, d.picked), (1, 2, 4));
        assert_eq!(steps.log, ["route", "admit", "queue", "pick"]);
    }
}
