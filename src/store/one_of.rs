//! "This column is one of these values" as a condition whose statement text
//! does not depend on how many values there are.
//!
//! `column IN ($1, …, $n)` is a different statement for every n: PostgreSQL
//! parses and plans each one again, and the driver's cache of prepared
//! statements (100 per connection) fills with variants of one query. The
//! fetch writer's groups hold from 1 to 256 users, so each of its statements
//! came in 60 to 70 texts over a 10,000-user fan-out (BENCHMARKS.md,
//! Fan-out). On PostgreSQL the values travel as one array parameter
//! (`column = ANY($1)`), prepared once per connection; SQLite has no
//! arrays and prepares in-process, so it keeps `IN` lists of at most
//! [`CHUNK`] values.

use sea_orm::sea_query::extension::postgres::PgFunc;
use sea_orm::sea_query::{
    ArrayType, Condition, Expr, ExprTrait, Func, FunctionCall, IntoColumnRef,
};
use sea_orm::{DbBackend, Value};

use super::rows::CHUNK;

/// The conditions that together select the rows whose `column` is one of
/// `values`: one on PostgreSQL, one per [`CHUNK`] values elsewhere, none
/// when there are no values (a statement over nothing is not run at all).
pub(super) fn one_of<C, V>(
    backend: DbBackend,
    column: C,
    values: impl IntoIterator<Item = V>,
) -> Vec<Expr>
where
    C: IntoColumnRef + Clone,
    V: Into<Value>,
{
    let values: Vec<Value> = values.into_iter().map(Into::into).collect();
    let Some(first) = values.first() else {
        return Vec::new();
    };
    if backend == DbBackend::Postgres {
        let array = Value::Array(first.array_type(), Some(Box::new(values)));
        return vec![Expr::col(column).eq(PgFunc::any(Expr::val(array)))];
    }
    values
        .chunks(CHUNK)
        .map(|chunk| Expr::col(column.clone()).is_in(chunk.iter().cloned()))
        .collect()
}

/// `unnest($1)` of `names` as one text-array parameter (PostgreSQL only):
/// a set of values as rows, for a statement that asks the same question of
/// each (a `LATERAL` subquery, `EXISTS` probes) in one text.
pub(super) fn unnest<'a>(names: impl IntoIterator<Item = &'a str>) -> FunctionCall {
    let names: Vec<Value> = names.into_iter().map(Into::into).collect();
    let array = Value::Array(ArrayType::String, Some(Box::new(names)));
    Func::cust("unnest").arg(array)
}

/// The conditions that together select the rows whose `a.0` is one of
/// `a.1` and whose `b.0` is one of `b.1`: each pair of [`one_of`]'s
/// conditions (one on PostgreSQL).
pub(super) fn one_of_each<A, B, V, W>(
    backend: DbBackend,
    a: (A, impl IntoIterator<Item = V>),
    b: (B, impl IntoIterator<Item = W>),
) -> Vec<Condition>
where
    A: IntoColumnRef + Clone,
    B: IntoColumnRef + Clone,
    V: Into<Value>,
    W: Into<Value>,
{
    let of_b = one_of(backend, b.0, b.1);
    let mut conditions = Vec::new();
    for these_a in one_of(backend, a.0, a.1) {
        for these_b in &of_b {
            conditions.push(Condition::all().add(these_a.clone()).add(these_b.clone()));
        }
    }
    conditions
}

#[cfg(test)]
mod tests {
    use super::*;
    use sea_orm::sea_query::{PostgresQueryBuilder, Query, SqliteQueryBuilder};

    fn select(backend: DbBackend, n: usize) -> Vec<(String, usize)> {
        let users: Vec<String> = (0..n).map(|i| format!("@u{i}:example.org")).collect();
        one_of(backend, "user_id", users.iter().map(String::as_str))
            .into_iter()
            .map(|condition| {
                let query = Query::select()
                    .column("user_id")
                    .from("t")
                    .and_where(condition)
                    .to_owned();
                let (sql, values) = match backend {
                    DbBackend::Postgres => query.build(PostgresQueryBuilder),
                    _ => query.build(SqliteQueryBuilder),
                };
                (sql, values.0.len())
            })
            .collect()
    }

    #[test]
    fn postgres_has_one_text_for_every_size() {
        let one = select(DbBackend::Postgres, 1);
        let many = select(DbBackend::Postgres, 2 * CHUNK + 1);
        assert_eq!(one.len(), 1);
        assert_eq!(many.len(), 1, "one statement, not chunks");
        assert_eq!(one[0].0, many[0].0, "the text does not depend on the size");
        assert_eq!(
            one[0].0,
            r#"SELECT "user_id" FROM "t" WHERE "user_id" = ANY($1)"#
        );
        assert_eq!(many[0].1, 1, "the values are one array parameter");
    }

    #[test]
    fn sqlite_lists_values_in_chunks() {
        let statements = select(DbBackend::Sqlite, 2 * CHUNK + 1);
        let sizes: Vec<usize> = statements.iter().map(|(_, n)| *n).collect();
        assert_eq!(sizes, [CHUNK, CHUNK, 1]);
        assert!(statements[0].0.contains(" IN ("));
    }

    #[test]
    fn pairs_of_sets_are_every_pair_of_chunks() {
        let many: Vec<String> = (0..CHUNK + 1).map(|i| format!("v{i}")).collect();
        let two = || ("b", ["x", "y"]);
        let sqlite = one_of_each(
            DbBackend::Sqlite,
            ("a", many.iter().map(String::as_str)),
            two(),
        );
        assert_eq!(sqlite.len(), 2, "two chunks of a, one of b");
        let pg = one_of_each(
            DbBackend::Postgres,
            ("a", many.iter().map(String::as_str)),
            two(),
        );
        assert_eq!(pg.len(), 1);
        let none = one_of_each(DbBackend::Postgres, ("a", Vec::<&str>::new()), two());
        assert!(none.is_empty());
    }

    #[test]
    fn no_values_no_statement() {
        assert!(select(DbBackend::Postgres, 0).is_empty());
        assert!(select(DbBackend::Sqlite, 0).is_empty());
    }
}
