//! The one error type of the pure core. The Python layer maps it to exceptions in
//! one place (`py/mod.rs`): `InvalidArgument` and `Snapshot` become `ValueError`,
//! `UnknownName` becomes `KeyError`, `NotInFlight` becomes `NotInFlightError`
//! (a `ValueError`).

/// Everything the core can refuse. Every fallible core call returns this, and a
/// call that returns an error has changed no state.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A value outside its documented domain: negative or zero sizes, NaN,
    /// malformed JSON, a limit that would be exceeded.
    #[error("{0}")]
    InvalidArgument(String),
    /// A pool, endpoint, tenant, entitlement or category name that is not known.
    #[error("unknown {kind}: {name:?}")]
    UnknownName { kind: &'static str, name: String },
    /// Ending a request that is not in flight (completed already, never
    /// started, or its lease expired): every `complete` says so the same way.
    #[error("{0}")]
    NotInFlight(String),
    /// Bytes given to `from_bytes` that are not a snapshot this version wrote.
    #[error("invalid snapshot: {0}")]
    Snapshot(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for `Error::InvalidArgument`.
pub fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidArgument(message.into())
}

/// Shorthand for `Error::UnknownName`.
pub fn unknown(kind: &'static str, name: impl Into<String>) -> Error {
    Error::UnknownName {
        kind,
        name: name.into(),
    }
}

/// Shorthand for `Error::NotInFlight`.
pub fn not_in_flight(message: impl Into<String>) -> Error {
    Error::NotInFlight(message.into())
}

/// `Ok(x)` if `x` is finite, else an `InvalidArgument` naming `what`.
pub fn finite(what: &str, x: f64) -> Result<f64> {
    if x.is_finite() {
        Ok(x)
    } else {
        Err(invalid(format!("{what} must be a finite number, got {x}")))
    }
}

/// `Ok(x)` if `x` is finite and > 0.
pub fn positive(what: &str, x: f64) -> Result<f64> {
    if finite(what, x)? > 0.0 {
        Ok(x)
    } else {
        Err(invalid(format!("{what} must be > 0, got {x}")))
    }
}

/// `Ok(x)` if `x` is finite and >= 0.
pub fn non_negative(what: &str, x: f64) -> Result<f64> {
    if finite(what, x)? >= 0.0 {
        Ok(x)
    } else {
        Err(invalid(format!("{what} must be >= 0, got {x}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_the_value() {
        assert!(finite("x", f64::NAN).is_err());
        assert_eq!(
            positive("rate", 0.0),
            Err(invalid("rate must be > 0, got 0"))
        );
        assert!(non_negative("w", -1.0).is_err());
        assert_eq!(non_negative("w", 0.0), Ok(0.0));
        assert_eq!(
            unknown("pool", "x").to_string(),
            "unknown pool: \"x\"".to_string()
        );
    }
}
