//! Remote users' cross-signing keys (master and self-signing).

use sea_orm::entity::prelude::*;

/// One cross-signing key of a remote user.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "cross_signing_key")]
pub struct Model {
    /// Owner of the key.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub user_id: String,
    /// `master` or `self_signing`.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub key_usage: String,
    /// The key object exactly as received.
    #[sea_orm(column_type = "Text")]
    pub key_json: String,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
