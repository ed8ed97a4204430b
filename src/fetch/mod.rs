//! Fetch: making stale device lists fresh again (SPEC §5.2, §5.3).
//!
//! * [`retry`]: the per-server back-off policy (pure);
//! * [`guard`]: which addresses a fetch may connect to (pure);
//! * [`answer`]: reading a `/user/devices` answer (pure);
//! * [`federation`]: the signed request, discovery and the guarded client;
//! * [`jobs`]: the fetch-job consumer that ties them to the store.

pub mod answer;
pub mod federation;
pub mod guard;
pub mod jobs;
pub mod retry;
