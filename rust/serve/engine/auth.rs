//! Who sends a request: the tenant its API key names (digests compared in
//! constant time), its refusals counted and logged, its VTC user, and
//! whether its entitlement is still in the running configuration.

use super::*;

impl Engine {
    /// The tenant owning `key` (None when no tenants are configured). A
    /// missing or unknown key is a 401, an expired one a 403. The key is
    /// hashed first, so the lookup's timing depends on the digest, not on how
    /// much of a real key was guessed; the final comparison is constant-time.
    pub fn authenticate(&self, key: Option<&[u8]>) -> std::result::Result<Option<usize>, Reject> {
        if self.tenants.is_empty() {
            return Ok(None);
        }
        let found = key.filter(|k| !k.is_empty()).and_then(|k| {
            let digest: [u8; 32] = Sha256::digest(k).into();
            let &t = self.keys.get(&digest)?;
            let ok = self.tenants[t]
                .digests
                .iter()
                .fold(subtle::Choice::from(0), |acc, d| {
                    acc | d[..].ct_eq(&digest[..])
                });
            bool::from(ok).then_some(t)
        });
        let Some(t) = found else {
            return Err(self.refuse(None, 401, "unknown-key", "missing or unknown API key", 0.0));
        };
        if let Some(at) = self.tenants[t].expires_at {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            if now >= at {
                return Err(self.refuse(Some(t), 403, "expired-key", "API key expired", 0.0));
            }
        }
        Ok(Some(t))
    }

    /// A refusal, counted per service class and reason, and logged
    /// (`refused`) once per state change of its reason.
    pub fn refuse(
        &self,
        tenant: Option<usize>,
        status: u16,
        reason: &str,
        message: impl Into<String>,
        retry_after_s: f64,
    ) -> Reject {
        let class = tenant.map_or("none", |t| self.tenants[t].service_class.as_str());
        let rej = Reject {
            status,
            reason: reason.into(),
            message: message.into(),
            retry_after_s,
        };
        if let Ok(shared) = self.shared() {
            shared.metrics.reject(class, reason);
            shared.log_refusal(&rej, self.tenant_name(tenant));
        }
        rej
    }

    /// The VTC user of a request: its fairness id scoped to its tenant (a
    /// tenant cannot weigh on another's share by naming its id), else the
    /// tenant's name; with no tenants (no one is authenticated), the
    /// fairness id as sent, else `anonymous`. Err: the fairness id is empty
    /// or too long.
    pub(super) fn vtc_user(
        &self,
        tenant: Option<usize>,
        fairness_id: Option<&str>,
    ) -> Result<Option<String>> {
        let Some(f) = fairness_id else {
            return Ok(None);
        };
        let Some(name) = self.tenant_name(tenant) else {
            crate::vtc::check_user(f)?;
            return Ok(Some(f.to_owned()));
        };
        // "<name length>:<name>:<id>": no two (tenant, id) pairs meet.
        let user = format!("{}:{name}:{f}", name.len());
        if f.is_empty() || user.len() > crate::vtc::MAX_USER_NAME_BYTES {
            return Err(invalid(format!(
                "must be 1 to {} bytes for tenant {name:?}, got {} bytes",
                crate::vtc::MAX_USER_NAME_BYTES - (user.len() - f.len()),
                f.len()
            )));
        }
        Ok(Some(user))
    }

    /// Whether `entitlement` of this engine's configuration is still one of
    /// the running configuration's: a reload that removed it also removed
    /// its admission state, so the streams still routed on this one (they
    /// finish on the configuration they opened on) skip admission for it.
    pub(super) fn entitlement_live(&self, entitlement: &str, shared: &Shared) -> bool {
        if shared.latest.load(Ordering::Acquire) == self.number {
            return true; // the running configuration
        }
        match shared.latest() {
            Some(latest) if !std::ptr::eq(Arc::as_ptr(&latest), self) => {
                latest.entitlements.contains(entitlement)
            }
            _ => true,
        }
    }
}
