//! The VTC router (AIBrix's `vtc-basic`, see `crate::vtc`), beside the
//! picker it wraps.

use super::{preset_specs, PickConfig, PickRequest, Pipeline, PoolPicker};
use crate::endpoint::set_in_flight;
use crate::error::{finite, invalid, Result};
use crate::snapshot::{restore, Reader, Writer};
use crate::vtc::{check_tokens, check_user, Fairness, VtcConfig};

const MAGIC: &[u8; 4] = b"RCVT";
const SNAPSHOT_VERSION: u16 = 2;

/// The VTC router: the endpoint picker's `vtc` preset (the `vtc` scorer
/// alone, ties to the first) over named endpoints and their running counts.
#[derive(Debug, Clone)]
pub struct VtcRouter {
    on: PoolPicker,
}

impl PartialEq for VtcRouter {
    fn eq(&self, other: &Self) -> bool {
        self.to_bytes() == other.to_bytes()
    }
}

impl VtcRouter {
    pub fn new<S: AsRef<str>>(endpoints: &[S], config: VtcConfig) -> Result<Self> {
        let config = config.check()?;
        let mut specs = preset_specs("vtc")?;
        for s in &mut specs {
            if s.name == "vtc" {
                s.params = config.to_params();
            }
        }
        let pipeline = Pipeline::from_specs(&specs, endpoints, &PickConfig::default())?;
        Ok(Self {
            on: PoolPicker::new(pipeline),
        })
    }

    fn fairness(&self) -> &Fairness {
        match self.on.pipeline.vtc() {
            Some(v) => v.fairness(),
            None => unreachable!("the vtc preset has a vtc scorer"),
        }
    }

    pub fn config(&self) -> &VtcConfig {
        self.fairness().config()
    }
    pub fn endpoints(&self) -> &[String] {
        self.on.names()
    }
    /// Running requests per endpoint, in endpoint order.
    pub fn running(&self) -> Vec<u64> {
        self.on.running()
    }
    /// Users with a non-empty window (as of the latest time seen).
    pub fn users_len(&self) -> usize {
        self.fairness().users_len()
    }

    /// The user's weighted token count in the window at `now`.
    pub fn user_tokens(&mut self, user: &str, now: f64) -> Result<f64> {
        let now = finite("now", now)?;
        match self.on.pipeline.vtc_mut() {
            Some(v) => Ok(v.tokens(user, now)),
            None => unreachable!("the vtc preset has a vtc scorer"),
        }
    }

    /// Routes a batch of requests one after the other (each charged and
    /// counted running before the next is routed); `running`, if given,
    /// first overwrites the endpoints' running counts. Returns endpoint indices.
    pub fn route_many<S: AsRef<str>>(
        &mut self,
        users: &[S],
        input_tokens: &[i64],
        output_tokens: &[i64],
        running: Option<&[i64]>,
        now: f64,
    ) -> Result<Vec<usize>> {
        let now = finite("now", now)?;
        if users.len() != input_tokens.len() || users.len() != output_tokens.len() {
            return Err(invalid(format!(
                "users, input_tokens and output_tokens differ in length: {}, {}, {}",
                users.len(),
                input_tokens.len(),
                output_tokens.len()
            )));
        }
        if self.on.states.is_empty() {
            return Err(invalid("the router has no endpoints"));
        }
        for ((user, &i), &o) in users.iter().zip(input_tokens).zip(output_tokens) {
            check_user(user.as_ref())?;
            check_tokens("input_tokens", i)?;
            check_tokens("output_tokens", o)?;
        }
        if let Some(r) = running {
            set_in_flight(&mut self.on.states, r)?;
        }
        let mut out = Vec::with_capacity(users.len());
        for ((user, &i), &o) in users.iter().zip(input_tokens).zip(output_tokens) {
            let req = PickRequest {
                fairness_id: Some(user.as_ref()),
                input_tokens: i as u64,
                output_tokens: o as u64,
                now,
                ..PickRequest::default()
            };
            let endpoint = self.on.start(&req)?.ok_or_else(|| invalid("no endpoint"))?;
            out.push(endpoint);
        }
        Ok(out)
    }

    /// Routes one request: charges `user` its estimated weighted tokens and
    /// counts it running on the chosen endpoint, whose index is returned.
    pub fn route(
        &mut self,
        user: &str,
        input_tokens: i64,
        output_tokens: i64,
        running: Option<&[i64]>,
        now: f64,
    ) -> Result<usize> {
        let endpoints =
            self.route_many(&[user], &[input_tokens], &[output_tokens], running, now)?;
        endpoints
            .first()
            .copied()
            .ok_or_else(|| invalid("no decision"))
    }

    /// Ends a request on `endpoint` and corrects `user`'s charge from the
    /// estimate (`est_*`, what `route` was given) to the actual usage.
    #[allow(clippy::too_many_arguments)]
    pub fn complete(
        &mut self,
        endpoint: &str,
        user: &str,
        est_input_tokens: i64,
        est_output_tokens: i64,
        input_tokens: i64,
        output_tokens: i64,
        now: f64,
    ) -> Result<()> {
        let now = finite("now", now)?;
        check_user(user)?;
        let ei = check_tokens("est_input_tokens", est_input_tokens)?;
        let eo = check_tokens("est_output_tokens", est_output_tokens)?;
        let i = check_tokens("input_tokens", input_tokens)?;
        let o = check_tokens("output_tokens", output_tokens)?;
        let e = self.on.index(endpoint)?;
        let req = PickRequest {
            fairness_id: Some(user),
            input_tokens: ei as u64,
            output_tokens: eo as u64,
            now,
            ..PickRequest::default()
        };
        self.on.complete(e, &req, i as u64, o as u64)
    }

    pub fn add_endpoint(&mut self, name: &str) -> Result<()> {
        self.on.add_endpoint(name).map(drop)
    }
    pub fn remove_endpoint(&mut self, name: &str) -> Result<()> {
        self.on.remove_endpoint(name).map(drop)
    }
    pub fn set_running(&mut self, counts: &[i64]) -> Result<()> {
        self.on.set_running(counts)
    }

    /// Settings, endpoints, running counts and every user's buckets.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(MAGIC, SNAPSHOT_VERSION);
        self.on.write_counts(&mut w);
        self.fairness().write(&mut w);
        w.finish()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        restore(bytes, MAGIC, SNAPSHOT_VERSION, "VTC router", Self::read)
    }

    fn read(r: &mut Reader<'_>) -> Result<Self> {
        let (names, running) = PoolPicker::read_counts(r)?;
        let fairness = Fairness::read(r)?;
        let mut router = Self::new(&names, *fairness.config())?;
        router.on.restore_running(&running);
        match router.on.pipeline.vtc_mut() {
            Some(v) => v.set_fairness(fairness),
            None => unreachable!("the vtc preset has a vtc scorer"),
        }
        Ok(router)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> VtcConfig {
        VtcConfig::default()
    }

    fn router() -> VtcRouter {
        VtcRouter::new(&["p0", "p1", "p2"], config()).expect("router")
    }

    #[test]
    fn scores_worked_by_hand() {
        let mut r = router();
        // No active user: bucket = max(1000, (1000 + 8000) / 2) = 4500, x = 0.
        assert_eq!(r.route("a", 100, 200, None, 0.0), Ok(0));
        assert_eq!(r.user_tokens("a", 0.0), Ok(500.0));
        // Only a (500) active: bucket = max(1000, 500) = 1000, x = 0.5;
        // scores: p0 0.5 + 1/100 = 0.51, p1 0.5 + 0 = 0.5, p2 1.5.
        assert_eq!(r.route("a", 100, 200, None, 1.0), Ok(1));
        // b has 0: x = 0; p0 0 + 0.01 beats p1 1 + 0.01.
        assert_eq!(r.route("b", 100, 200, None, 2.0), Ok(0));
        // a (1000) with totals {500, 1000}: bucket 1000, x = 1: p1 0.01 wins.
        assert_eq!(r.route("a", 0, 0, None, 3.0), Ok(1));
        // A heavy user maps to the last endpoint: x = min(20000 / 10250, 2) = 1.95.
        assert_eq!(r.route("h", 20_000, 0, None, 4.0), Ok(0));
        assert_eq!(r.route("h", 0, 0, None, 5.0), Ok(2));
        // Utilization moves a request off a full endpoint: p0 at 100 running
        // scores 0 + 1, p1 scores |1 - 0| + 0 = 1: a tie, the lower index.
        assert_eq!(r.route("z", 0, 0, Some(&[100, 0, 0]), 6.0), Ok(0));
        assert_eq!(r.route("z", 0, 0, Some(&[101, 0, 0]), 6.0), Ok(0));
        assert_eq!(r.route("z", 0, 0, Some(&[100, 0, 0]), 6.0), Ok(0));
        let mut uw = VtcRouter::new(
            &["p0", "p1"],
            VtcConfig {
                utilization_weight: 2.0,
                ..config()
            },
        )
        .expect("router");
        assert_eq!(uw.route("z", 0, 0, Some(&[60, 0]), 0.0), Ok(1));
        assert_eq!(uw.running(), &[60, 1]);
    }

    #[test]
    fn window_expires_and_completion_corrects() {
        let mut r = router();
        assert_eq!(r.route("a", 100, 100, None, 0.0), Ok(0));
        assert_eq!(r.user_tokens("a", 269.9), Ok(300.0));
        // At t = 300 the window holds buckets 1..=10; bucket 0 expired.
        assert_eq!(r.user_tokens("a", 300.0), Ok(0.0));
        assert_eq!(r.users_len(), 0);
        r.route("a", 100, 100, None, 301.0).expect("route");
        r.complete("p0", "a", 100, 100, 100, 400, 302.0)
            .expect("complete");
        assert_eq!(r.user_tokens("a", 302.0), Ok(900.0));
        assert_eq!(r.running(), &[1, 0, 0]);
        // a (900) alone: bucket 1000, x = 0.9: p1 (0.1) beats p0 (0.91).
        assert_eq!(r.route("a", 0, 1000, None, 303.0), Ok(1));
        r.complete("p1", "a", 0, 1000, 0, 0, 303.0)
            .expect("complete");
        // 900 + 2000 - 2000.
        assert_eq!(r.user_tokens("a", 303.0), Ok(900.0));
        assert_eq!(r.route("a", 0, 0, None, 304.0), Ok(1));
        r.complete("p1", "a", 0, 5000, 0, 0, 304.0)
            .expect("complete");
        assert_eq!(r.user_tokens("a", 304.0), Ok(0.0), "never below zero");
        // A correction for a user no longer held is not a new charge.
        r.set_running(&[1, 0, 0]).expect("set");
        r.complete("p0", "ghost", 500, 0, 0, 0, 305.0)
            .expect("complete");
        assert_eq!(r.user_tokens("ghost", 305.0), Ok(0.0));
    }

    #[test]
    fn bounded_users_and_errors_change_nothing() {
        let mut r = VtcRouter::new(
            &["p0", "p1"],
            VtcConfig {
                max_users: 2,
                ..config()
            },
        )
        .expect("router");
        r.route("a", 10, 0, None, 0.0).expect("route");
        r.route("b", 10, 0, None, 40.0).expect("route");
        r.route("c", 10, 0, None, 80.0).expect("route");
        assert_eq!(r.users_len(), 2);
        assert_eq!(r.user_tokens("a", 80.0), Ok(0.0), "least recent forgotten");
        assert_eq!(r.user_tokens("b", 80.0), Ok(10.0));

        let before = r.to_bytes();
        assert!(r.route("", 1, 1, None, 90.0).is_err());
        assert!(r.route(&"u".repeat(257), 1, 1, None, 90.0).is_err());
        assert!(r.route("a", -1, 1, None, 90.0).is_err());
        assert!(r.route("a", 1, 1 << 31, None, 90.0).is_err());
        assert!(r.route("a", 1, 1, None, f64::NAN).is_err());
        assert!(r.route("a", 1, 1, Some(&[1]), 90.0).is_err());
        assert!(r
            .route_many(&["a", "b"], &[1, 1], &[1], None, 90.0)
            .is_err());
        assert!(r
            .route_many(&["a", ""], &[1, 1], &[1, 1], None, 90.0)
            .is_err());
        assert!(r.complete("p9", "a", 1, 1, 1, 1, 90.0).is_err());
        assert!(
            r.complete("p1", "a", 1, 1, 1, 1, 90.0).is_err(),
            "none running"
        );
        assert!(r.complete("p0", "a", 1, -1, 1, 1, 90.0).is_err());
        assert_eq!(r.to_bytes(), before);
        for bad in [
            VtcConfig {
                window_s: 0.0,
                ..config()
            },
            VtcConfig {
                input_weight: -1.0,
                ..config()
            },
            VtcConfig {
                min_tokens: 0.0,
                ..config()
            },
            VtcConfig {
                max_tokens: 10.0,
                ..config()
            },
            VtcConfig {
                max_endpoint_load: f64::NAN,
                ..config()
            },
            VtcConfig {
                max_users: 0,
                ..config()
            },
        ] {
            assert!(VtcRouter::new(&["p"], bad).is_err());
        }
        let mut empty = VtcRouter::new::<&str>(&[], config()).expect("router");
        assert!(empty.route("a", 1, 1, None, 0.0).is_err());
    }

    #[test]
    fn batch_equals_one_by_one_and_snapshots_restore() {
        let users = ["h", "a", "h", "b", "h", "h", "c", "a", "h", "b"];
        let ins = [900, 10, 800, 20, 900, 700, 5, 10, 950, 30];
        let outs = [300, 5, 200, 5, 100, 300, 1, 2, 300, 4];
        let mut one = router();
        let singles: Vec<usize> = (0..users.len())
            .map(|i| {
                let running: &[i64] = &[3, 1, 0];
                one.route(users[i], ins[i], outs[i], (i == 0).then_some(running), 7.0)
                    .expect("route")
            })
            .collect();
        let mut many = router();
        let batch = many
            .route_many(&users, &ins, &outs, Some(&[3, 1, 0]), 7.0)
            .expect("many");
        assert_eq!(batch, singles);
        assert_eq!(one, many);
        assert!(singles.contains(&2) && singles.contains(&0));

        let bytes = one.to_bytes();
        let back = VtcRouter::from_bytes(&bytes).expect("restore");
        assert_eq!(back, one);
        assert_eq!(back.to_bytes(), bytes);
        for cut in 0..bytes.len() {
            assert!(VtcRouter::from_bytes(&bytes[..cut]).is_err());
        }
        one.add_endpoint("p3").expect("add");
        one.remove_endpoint("p0").expect("remove");
        assert_eq!(one.endpoints(), &["p1", "p2", "p3"]);
        assert!(one.remove_endpoint("p0").is_err());
    }
}
