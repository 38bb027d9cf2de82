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
    /// expiry or displacement; it may give back and take again what
    /// admission holds). Today every request is dispatched at once.
    fn queue(
        &mut self,
        _pool: &Self::Pool,
        _admitted: &mut Self::Admitted,
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
    taken.steps.queue(pool, &mut *admitted).await?;
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
        fn queue(
            &mut self,
            _: &u32,
            _: &mut u32,
        ) -> impl Future<Output = Result<(), &'static str>> {
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

    /// The pure parts of one pool: a pipeline whose plugins learn (prefix,
    /// VTC, session affinity) over counted endpoints, the admission layer,
    /// and the router's count of requests in the pool.
    struct Parts {
        picker: crate::pick::PoolPicker,
        admission: crate::admission::AdmissionController,
        routed: u64,
    }

    fn new_parts() -> Parts {
        use crate::admission::{AdmissionController, Entitlement, Quota};
        use crate::pick::{PickConfig, Pipeline, PluginSpec, PoolPicker};
        let specs = [
            PluginSpec::new("healthy", 1.0),
            PluginSpec::with("prefix", 1.0, serde_json::json!({"block_size": 4})),
            PluginSpec::new("vtc", 1.0),
            PluginSpec::new("session-affinity", 1.0),
            PluginSpec::with("max-score", 1.0, serde_json::json!({"ties": "first"})),
        ];
        let pipeline = Pipeline::from_specs(&specs, &["e0", "e1", "e2"], &PickConfig::default())
            .expect("pipeline");
        let quota = Quota::new("q", 1e9, 1 << 40, 1000, 0).expect("quota");
        let ent = |name: &str, concurrency| {
            Entitlement::new(
                name,
                name,
                "q",
                "guaranteed",
                1000.0,
                1e8,
                1 << 38,
                concurrency,
                "bound",
            )
            .expect("entitlement")
        };
        let admission = AdmissionController::new(
            vec![quota],
            vec![ent("open", 1000), ent("capped", 1)],
            4096,
            60.0,
        )
        .expect("admission");
        Parts {
            picker: PoolPicker::new(pipeline),
            admission,
            routed: 0,
        }
    }

    /// One request as the parts see it; `cancel`: the client leaves while
    /// it waits in the queue.
    struct Ask {
        tenant: &'static str,
        hashes: Vec<u64>,
        session: String,
        est: (u64, u64),
        now: f64,
        cancel: bool,
    }

    impl Ask {
        fn pick_request(&self) -> crate::pick::PickRequest<'_> {
            crate::pick::PickRequest {
                hashes: &self.hashes,
                fairness_id: Some(self.tenant),
                session: Some(&self.session),
                input_tokens: self.est.0,
                output_tokens: self.est.1,
                now: self.now,
                ..Default::default()
            }
        }
    }

    /// One request's steps over [`Parts`].
    struct Req<'p> {
        parts: &'p mut Parts,
        ask: Ask,
    }

    impl Steps for Req<'_> {
        type Pool = ();
        type Admitted = Option<u64>;
        type Picked = usize;
        type Refused = u16;
        fn route(&mut self) -> Result<(), u16> {
            self.parts.routed += 1;
            Ok(())
        }
        fn admit(&mut self, _: &()) -> impl Future<Output = Result<Option<u64>, u16>> {
            let (i, o) = (self.ask.est.0 as i64, self.ask.est.1 as i64);
            let a = self
                .parts
                .admission
                .admit(self.ask.tenant, i, Some(o), self.ask.now);
            let a = a.expect("valid numbers");
            std::future::ready(if a.admitted {
                Ok(a.ticket)
            } else {
                Err(a.status)
            })
        }
        fn queue(&mut self, _: &(), _: &mut Option<u64>) -> impl Future<Output = Result<(), u16>> {
            let cancel = self.ask.cancel;
            async move {
                if cancel {
                    std::future::pending::<()>().await;
                }
                Ok(())
            }
        }
        fn pick(&mut self, _: &(), _: &Option<u64>) -> Result<usize, u16> {
            let req = self.ask.pick_request();
            match self.parts.picker.start(&req) {
                Ok(Some(e)) => Ok(e),
                _ => Err(503),
            }
        }
        fn unadmit(&mut self, _: &(), ticket: Option<u64>) {
            if let Some(t) = ticket {
                let done = self.parts.admission.complete(t, 0, 0, 0.0, self.ask.now);
                done.expect("in flight");
            }
        }
        fn unroute(&mut self, _: ()) {
            self.parts.routed -= 1;
        }
    }

    /// Ends a request dispatched to `endpoint` with `ticket`, as a lease
    /// does: the picker's count and charges (`req` as it was picked), the
    /// ticket, the pool count.
    fn end(parts: &mut Parts, ask: &Ask, taken: (Option<u64>, usize), usage: (u64, u64)) {
        let (ticket, endpoint) = taken;
        let mut pick = ask.pick_request();
        pick.now += 0.5;
        parts
            .picker
            .complete(endpoint, &pick, usage.0, usage.1)
            .expect("in flight");
        if let Some(t) = ticket {
            let (i, o) = (usage.0 as i64, usage.1 as i64);
            parts
                .admission
                .complete(t, i, o, 0.1, pick.now)
                .expect("in flight");
        }
        parts.routed -= 1;
    }

    /// Everything the parts keep: the picker's snapshot (prefix index,
    /// VTC counts, sessions, picks, cursor), counts in flight, the pool
    /// count and admission's requests in flight.
    fn kept(parts: &Parts) -> String {
        let a = &parts.admission;
        format!(
            "{:?} {:?} {} {:?}",
            parts.picker.pipeline.to_bytes(),
            parts.picker.running(),
            parts.routed,
            a.quota_in_flight("q"),
        )
    }

    /// Nothing a refused request touched stays changed: over random mixes
    /// of requests answered, failed (no usage), cancelled in the queue and
    /// refused by admission (`capped` admits one at a time and its first
    /// request is held to the end), the parts keep exactly what a run that
    /// never saw the refused requests keeps.
    #[test]
    fn a_refused_request_leaves_no_trace_in_the_pure_parts() {
        for seed in 0..50u64 {
            let mut rng = crate::rng::Rng::new(seed);
            let mut draw = |m: u64| rng.next_u64() % m;
            // (capped?, prompt, session, outcome: 0 answered, 1 failed, 2 cancelled)
            let ops: Vec<(bool, u64, u64, u64)> = (0..40)
                .map(|_| (draw(3) == 0, draw(4), draw(5), draw(3)))
                .collect();
            let mut runs = Vec::new();
            for skip_refused in [false, true] {
                let mut parts = new_parts();
                let prompt = |k: u64| -> Vec<u64> { (0..3 + k).map(|b| k * 100 + b).collect() };
                let mut blocker = Req {
                    parts: &mut parts,
                    ask: Ask {
                        tenant: "capped",
                        hashes: prompt(0),
                        session: "s-held".into(),
                        est: (10, 10),
                        now: 0.0,
                        cancel: false,
                    },
                };
                let held = dispatch_now(&mut blocker)
                    .expect("ready")
                    .expect("admitted");
                let (held_ticket, held_endpoint) = (held.admitted, held.picked);
                let mut refused = 0;
                for (n, &(capped, k, session, outcome)) in ops.iter().enumerate() {
                    if skip_refused && capped {
                        continue;
                    }
                    let mut req = Req {
                        parts: &mut parts,
                        ask: Ask {
                            tenant: if capped { "capped" } else { "open" },
                            hashes: prompt(k),
                            session: format!("s{session}"),
                            est: (20 + k, 30),
                            now: 1.0 + n as f64,
                            cancel: outcome == 2,
                        },
                    };
                    let taken = match dispatch_now(&mut req) {
                        None => {
                            assert!(!capped && outcome == 2, "only a cancel waits");
                            continue;
                        }
                        Some(Err(status)) => {
                            assert!(capped && status == 429, "{status}");
                            refused += 1;
                            continue;
                        }
                        Some(Ok(d)) => (d.admitted, d.picked),
                    };
                    let usage = if outcome == 0 {
                        (req.ask.est.0, 7)
                    } else {
                        (0, 0)
                    };
                    end(req.parts, &req.ask, taken, usage);
                }
                let mid = kept(&parts);
                let done = crate::pick::PickRequest {
                    now: 100.0,
                    ..Default::default()
                };
                parts
                    .picker
                    .complete(held_endpoint, &done, 10, 10)
                    .expect("held");
                if let Some(t) = held_ticket {
                    parts
                        .admission
                        .complete(t, 10, 10, 0.1, 100.0)
                        .expect("held");
                }
                runs.push((mid, kept(&parts), refused));
            }
            let capped = ops.iter().filter(|o| o.0).count();
            assert_eq!((runs[0].2, runs[1].2), (capped, 0), "seed {seed}");
            assert_eq!(runs[0].0, runs[1].0, "seed {seed}: while held");
            assert_eq!(runs[0].1, runs[1].1, "seed {seed}: after");
        }
    }
}
