//! device-list-updater keeps a Matrix homeserver's copy of remote users'
//! device lists and cross-signing keys up to date.
//!
//! The modules follow the pipeline; dependencies run one way, down this list
//! (a module uses only those above it):
//!
//! * `startup`, `shutdown`, [`faults`], `metrics`, `tls`: the start-up wait,
//!   the stop signal and drop guards, crash-test fault injection (test
//!   builds only), the Prometheus registry, the one TLS crypto provider;
//! * [`server_key`]: our server's ed25519 key, which federation requests are
//!   signed with (not the cross-signing keys of `input::signing_key`);
//! * [`input`]: raw JetStream messages become checked values or dead letters;
//!   [`input::InputKind`] is the one list of input kinds;
//! * [`key_change`]: the key-change events (SPEC §4.2);
//! * [`decide`]: pure rules say, per update, apply or mark the user stale,
//!   what a fetched list changes, and who shares a room with us, and
//!   which key-change events follow;
//! * [`config`]: every setting, typed, with its defaults (SPEC §3);
//! * [`store`]: the plans written with sea-orm in one transaction each, with
//!   their key-change events in an outbox;
//! * [`bus`]: JetStream streams, consumers, fetch jobs, the input lease and
//!   the outbox publisher;
//! * [`fetch`]: stale lists fetched from remote servers (signed, guarded,
//!   with per-server and per-user back-off);
//! * `ingest`: the batch loop that ties input, rules, store and bus together;
//! * `sweep`: our server joining or leaving a room, applied to its remote
//!   members in bounded chunks (SPEC §5.5.5);
//! * `rpc`, `http`: the request-reply subjects (SPEC §4.4), the health and
//!   metrics listener (§7);
//! * [`worker`]: starts everything for `device-list-updater run`;
//! * [`admin`]: the `admin` commands, over the same store and bus;
//! * [`telemetry`]: logs and traces;
//! * `testkit` (feature `testkit`, for tests, the demo and benchmarks): a
//!   private nats-server, databases, a mock remote homeserver fleet.

#![warn(missing_docs)]

pub mod admin;
pub mod bus;
pub mod config;
pub mod decide;
pub mod faults;
pub mod fetch;
pub(crate) mod http;
pub(crate) mod ingest;
pub mod input;
pub mod key_change;
pub(crate) mod metrics;
pub(crate) mod rpc;
pub mod server_key;
pub(crate) mod shutdown;
pub(crate) mod startup;
pub mod store;
pub(crate) mod sweep;
pub mod telemetry;
#[cfg(feature = "testkit")]
pub mod testkit;
pub(crate) mod tls;
pub mod worker;
