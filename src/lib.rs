//! device-list-updater keeps a Matrix homeserver's copy of remote users'
//! device lists and cross-signing keys up to date.
//!
//! The modules follow the pipeline:
//!
//! * [`input`]: raw JetStream messages become checked values or dead letters;
//! * [`decide`]: pure rules say, per update, apply or mark the user stale;
//! * [`fetch`]: stale lists are fetched from remote servers (signed, guarded,
//!   with per-server back-off);
//! * [`store`]: the plan is written with sea-orm in one transaction, with its
//!   key-change events in an outbox;
//! * [`bus`]: JetStream streams, consumers, fetch jobs and the outbox publisher;
//! * [`ingest`]: the batch loop that ties them together;
//! * [`rpc`]: the query and resync request-reply subjects;
//! * [`worker`]: starts everything for `device-list-updater run`.

pub mod admin;
pub mod bus;
pub mod config;
pub mod decide;
pub mod fetch;
pub mod http;
pub mod ingest;
pub mod input;
pub mod key_change;
pub mod metrics;
pub mod rpc;
pub mod signing_key;
pub mod store;
pub mod telemetry;
pub mod testkit;
pub mod tls;
pub mod worker;
