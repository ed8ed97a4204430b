//! Fetch: making stale device lists fresh again (SPEC §5.2, §5.3).
//!
//! * `retry`: whose failure a failed fetch is, and the back-off (pure);
//! * `guard`: which addresses a fetch may connect to (pure);
//! * [`answer`]: reading a `/user/devices` answer (pure);
//! * `discovery`: SRV and port 8448 for hostnames (pure choice over a DNS trait);
//! * [`federation`]: the signed request, discovery and the guarded client;
//! * `jobs`: the fetch-job consumer that ties them together (and the look
//!   for work queued while a job ran, after it ends);
//! * `writer`: stores fetched lists in groups, one transaction each;
//! * `gather`: what tasks hand over a few milliseconds apart, served together;
//! * `wake`: input from a server ends its job's wait (rule pure);
//! * `queue`: the one way in for users that need fetching: enqueue their
//!   servers' jobs and start parked ones;
//! * `rescan`: at start-up, the servers whose jobs may have been lost;
//! * [`give_way`]: the fan-out gives way to ingest while it has a backlog;
//! * `resync`: a resync asked for outside the input stream;
//! * `revalidate`: the pacer that queues lists due for a revalidation.

pub mod answer;
pub(crate) mod discovery;
pub mod error;
pub mod federation;
pub(crate) mod gather;
pub mod give_way;
pub(crate) mod guard;
pub(crate) mod jobs;
pub(crate) mod queue;
pub(crate) mod rescan;
pub(crate) mod resync;
pub(crate) mod retry;
pub(crate) mod revalidate;
pub(crate) mod wake;
pub(crate) mod writer;
