//! Filter `serves-adapter`: keeps the endpoints that serve the request's LoRA
//! adapter (`vllm:lora_requests_info`); every endpoint for the base model.
//! Soft: when none serves it, any endpoint may load it.

use super::PickRequest;
use crate::endpoint::EndpointState;

pub fn keep(req: &PickRequest<'_>, s: &EndpointState) -> bool {
    req.adapter
        .is_none_or(|a| s.adapters.iter().any(|x| x == a))
}
