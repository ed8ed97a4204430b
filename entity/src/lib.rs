//! sea-orm entities of device-list-updater, one module per table.
//!
//! The schema itself lives in the `migration` crate; `docs/storage.md` explains
//! what each table is for.

pub mod cross_signing_key;
pub mod fetch_server;
pub mod key_change_outbox;
pub mod member_key_link;
pub mod remote_device;
pub mod remote_server;
pub mod remote_user;
pub mod revalidation;
pub mod room;
pub mod room_member;
pub mod room_user;
pub mod service_meta;
pub mod shared_user;
pub mod stale_user;
