//! Structured logs: one JSON object a line on stderr, the same shape as the
//! Python control plane's (`{"ts", "level", "event", ...fields}`), through
//! `tracing`. Python's logging setup decides the level ([`set_level`]).
//! Nothing here ever receives an API key: callers log the tenant's name.

use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// The lowest Python logging level that is written (10 debug ... 50 critical);
/// above 50: nothing.
static LEVEL: AtomicU8 = AtomicU8::new(20);
static INSTALL: Once = Once::new();

fn python_level(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        _ => 10,
    }
}

fn level_name(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "error",
        Level::WARN => "warning",
        Level::INFO => "info",
        _ => "debug",
    }
}

/// Installs the JSON writer (once per process) and sets the level, a Python
/// logging level number.
pub fn set_level(python_level: u8) {
    LEVEL.store(python_level, Ordering::Relaxed);
    INSTALL.call_once(|| {
        let subscriber = tracing_subscriber::registry().with(JsonLines);
        // Another global subscriber (an embedding application's) keeps precedence.
        let _ = tracing::subscriber::set_global_default(subscriber);
    });
}

pub fn enabled(level: &Level) -> bool {
    python_level(level) >= LEVEL.load(Ordering::Relaxed)
}

struct JsonLines;

fn is_ours(meta: &Metadata<'_>) -> bool {
    meta.target().starts_with("routecore")
}

struct Fields(Map<String, Value>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }
}

impl<S: Subscriber> Layer<S> for JsonLines {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        // Only routecore's own events (never its libraries' trace output, which
        // then costs nothing); their level can change at run time.
        if is_ours(meta) {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        is_ours(meta) && enabled(meta.level())
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| (d.as_secs_f64() * 1e6).round() / 1e6)
            .unwrap_or(0.0);
        let mut entry = Map::new();
        entry.insert("ts".into(), ts.into());
        entry.insert("level".into(), level_name(meta.level()).into());
        let mut fields = Fields(Map::new());
        event.record(&mut fields);
        if let Some(message) = fields.0.remove("message") {
            entry.insert("event".into(), message);
        }
        entry.extend(fields.0);
        let mut line = Value::Object(entry).to_string();
        line.push('\n');
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// How often a fault that goes on is summarised ([`Repeats::period`]).
pub const REPEAT_PERIOD: Duration = Duration::from_secs(60);

/// What a [`Repeats`] says about one occurrence of a fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Occurrence {
    /// The first of a run, or the first after a period of silence: write it,
    /// with `suppressed` (the occurrences not written since the last line).
    Log { suppressed: u64 },
    /// A repeat inside the period: counted, not written.
    Quiet,
}

/// One log line per state change, never one per occurrence: a fault that
/// repeats (Redis down, a garbage KV frame, a dead endpoint, a flood of
/// refusals) is written the first time, then counted silently; while it goes
/// on, one line every `period` carries the count suppressed since the last
/// line, and [`Repeats::end`] (the state changed back) hands the count to
/// the recovery line. Cheap on the hot path: one uncontended lock, no
/// allocation. The fault's metric is counted by the caller for every
/// occurrence, written or not.
pub struct Repeats {
    period: Duration,
    state: Mutex<RepeatState>,
}

#[derive(Default)]
struct RepeatState {
    /// When the last line of the current run was written (None: no run).
    last: Option<Instant>,
    suppressed: u64,
}

impl Default for Repeats {
    fn default() -> Self {
        Self::new(REPEAT_PERIOD)
    }
}

impl Repeats {
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            state: Mutex::new(RepeatState::default()),
        }
    }

    /// One occurrence at `now`: whether to write it.
    pub fn occur(&self, now: Instant) -> Occurrence {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match st.last {
            Some(last) if now.saturating_duration_since(last) < self.period => {
                st.suppressed += 1;
                Occurrence::Quiet
            }
            _ => {
                st.last = Some(now);
                Occurrence::Log {
                    suppressed: std::mem::take(&mut st.suppressed),
                }
            }
        }
    }

    /// The fault is over: `Some(suppressed)` when a run was going on (write
    /// the recovery line with that count), `None` when there was none.
    pub fn end(&self) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.last.take().map(|_| std::mem::take(&mut st.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_write_the_first_then_one_summary_per_period_and_the_end() {
        let r = Repeats::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(r.occur(t0), Occurrence::Log { suppressed: 0 });
        for i in 1..=5 {
            assert_eq!(r.occur(t0 + Duration::from_secs(i)), Occurrence::Quiet);
        }
        // A period after the last line: written, with what was held back.
        assert_eq!(
            r.occur(t0 + Duration::from_secs(10)),
            Occurrence::Log { suppressed: 5 }
        );
        assert_eq!(r.occur(t0 + Duration::from_secs(11)), Occurrence::Quiet);
        assert_eq!(r.end(), Some(1));
        // Nothing going on: no recovery line; the next fault starts a new run.
        assert_eq!(r.end(), None);
        assert_eq!(
            r.occur(t0 + Duration::from_secs(12)),
            Occurrence::Log { suppressed: 0 }
        );
    }
}
