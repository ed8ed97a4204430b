//! Remote servers whose fetch job is waiting: backing off after server
//! failures, or parked until the first of its stale users' own waits ends.
//! A server without a row has nothing to wait for.

use sea_orm::entity::prelude::*;

/// One server's fetch state.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "fetch_server")]
pub struct Model {
    /// The remote server.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub server_name: String,
    /// Failures of the server itself in a row (no answer, 5xx, 429, 401).
    pub failures: i32,
    /// When the server's job runs again (Unix milliseconds; 0: not waiting).
    pub next_attempt_ms: i64,
    /// When the server last failed (Unix ms): only what is heard from it
    /// after that shows it is up again.
    pub failed_at_ms: i64,
    /// When an update from the server last ended its back-off (Unix ms).
    pub last_wake_ms: i64,
    /// Why the server's last request failed.
    #[sea_orm(column_type = "Text", nullable)]
    pub last_error: Option<String>,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
