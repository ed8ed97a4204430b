//! Small named values that belong to the database itself, such as the
//! instance id that makes `Nats-Msg-Id`s unique across database resets.

use sea_orm::entity::prelude::*;

/// One named value.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "service_meta")]
pub struct Model {
    /// The value's name.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub name: String,
    /// The value.
    #[sea_orm(column_type = "Text")]
    pub value: String,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
