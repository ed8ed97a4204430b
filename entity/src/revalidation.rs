//! Users picked for a revalidation (SPEC §5.7), waiting for their server's
//! fetch job. A row's presence is the pick; a fetch of the user, of any
//! kind, ends it.

use sea_orm::entity::prelude::*;

/// One user to fetch again although it is not stale.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "revalidation")]
pub struct Model {
    /// The user.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub user_id: String,
    /// The user's server, whose fetch job runs the revalidation.
    #[sea_orm(column_type = "Text")]
    pub server_name: String,
    /// When the user was picked (Unix ms).
    pub queued_at_ms: i64,
    /// Unusable answers in a row (the user's own back-off, SPEC §5.2).
    pub failures: i32,
    /// When the user may be asked for again (Unix ms; 0: now).
    pub next_attempt_ms: i64,
    /// Why the last attempt failed.
    #[sea_orm(column_type = "Text", nullable)]
    pub last_error: Option<String>,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
