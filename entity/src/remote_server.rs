//! What a remote server's answers came to (SPEC §5.7.4, `admin servers`):
//! its last successful fetch and its revalidations and divergences. A
//! server gets a row at its first successful fetch.

use sea_orm::entity::prelude::*;

/// One remote server's figures.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "remote_server")]
pub struct Model {
    /// The remote server.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub server_name: String,
    /// When a fetch from it last succeeded (Unix ms).
    pub last_success_ms: i64,
    /// Revalidations that got an answer.
    pub revalidations: i64,
    /// Revalidations whose answer differed from what was stored: updates
    /// the server did not send us.
    pub divergences: i64,
    /// When the last divergence was found (Unix ms; 0: never).
    pub last_divergence_ms: i64,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
