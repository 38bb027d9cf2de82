//! Filter `saturation`: drops endpoints whose engine queue (scraped waiting
//! requests plus the dispatches since that scrape) is above `max_waiting` or
//! whose KV-cache use is above `max_kv_usage` (the GIE's saturation
//! detector, [`crate::endpoint::Saturation`]). Unknown values pass. Soft:
//! when every endpoint is saturated the filter is skipped.
