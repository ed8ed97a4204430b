//! What a failed request means for its job (SPEC §5.2): blamed on the
//! user, who alone backs off, or on the server, whose job ends with the
//! server's back-off.

use std::time::Duration;

use ruma::OwnedServerName;

use super::request::Asked;
use super::{Fetcher, JobEnd, Running};
use crate::fetch::federation::FetchFailure;
use crate::fetch::retry::{Blame, blame, random_unit};
use crate::store::now_ms;

impl Fetcher {
    /// What one user's fetch means for the job: None to go on with the next
    /// user, or how the job ends (the server failed, or a local problem).
    pub(super) async fn after_fetch(
        &self,
        job: &mut Running<'_>,
        asked: Asked<'_>,
        result: Result<(), FetchFailure>,
    ) -> Option<JobEnd> {
        let answered = result
            .as_ref()
            .map_or_else(|f| blame(f.kind) == Blame::User, |()| true);
        if job.backing_off && answered {
            // It answered: the server's back-off is over.
            job.backing_off = false;
            if let Err(e) = self
                .in_turn(|| self.store.server_answered(job.server))
                .await
            {
                tracing::warn!(error = %e, server = %job.server, "cannot clear the server's back-off");
            }
        }
        let failure = result.err()?;
        let user = asked.user();
        tracing::info!(%user, reason = %failure.reason, "fetch failed");
        let charged = blame(failure.kind);
        if charged == Blame::User {
            job.users_failed += 1;
            // Its back-off and `last_error` in one write.
            self.user_failed(asked, &failure).await;
            return None;
        }
        // Shown by the resync RPC and `admin stale`; a revalidation leaves
        // the user as it was (SPEC §5.7.3).
        if let Asked::Stale(_) = asked
            && let Err(e) = self
                .in_turn(|| self.store.note_fetch_error(user, &failure.reason))
                .await
        {
            tracing::debug!(error = %e, "cannot record the fetch error");
        }
        Some(match charged {
            Blame::Server => self.server_failed(job.server, job.failures, failure).await,
            Blame::User | Blame::Local => JobEnd::Local,
        })
    }

    /// The server failed: its back-off grows; recorded before the NAK so a
    /// wake-up can find it.
    async fn server_failed(
        &self,
        server: &OwnedServerName,
        failures: u32,
        failure: FetchFailure,
    ) -> JobEnd {
        let failures = failures.saturating_add(1);
        let (wait, until) = self.next_attempt(failures, failure.asked);
        if let Err(e) = self
            .in_turn(|| self.store.drop_server_revalidations(server))
            .await
        {
            tracing::debug!(error = %e, %server, "cannot drop the server's queued revalidations");
        }
        if let Err(e) = self
            .in_turn(|| {
                self.store
                    .set_server_wait(server, failures, until, Some(&failure.reason))
            })
            .await
        {
            tracing::warn!(error = %e, %server, "cannot record the server's back-off");
        }
        JobEnd::ServerFailed {
            failures,
            wait,
            error: failure.reason,
        }
    }

    /// The wait after the `failures`-th failure in a row (`asked`: what the
    /// remote asked for), and the Unix ms when it is over.
    fn next_attempt(&self, failures: u32, asked: Option<Duration>) -> (Duration, i64) {
        let wait = self.policy.wait(failures, asked, random_unit());
        let until = now_ms().saturating_add(i64::try_from(wait.as_millis()).unwrap_or(i64::MAX));
        (wait, until)
    }

    /// One user's answer was unusable: that user alone backs off (its
    /// stale mark or its queued revalidation keeps the wait).
    async fn user_failed(&self, asked: Asked<'_>, failure: &FetchFailure) {
        let failures = asked.failures().saturating_add(1);
        let (_, until) = self.next_attempt(failures, failure.asked);
        let user = asked.user();
        let noted = match asked {
            Asked::Stale(_) => {
                self.in_turn(|| {
                    self.store
                        .note_user_failure(user, failures, until, &failure.reason)
                })
                .await
            }
            Asked::Revalidation(_) => {
                self.in_turn(|| {
                    self.store
                        .note_revalidation_failure(user, failures, until, &failure.reason)
                })
                .await
            }
        };
        if let Err(e) = noted {
            tracing::warn!(error = %e, %user, "cannot record the user's back-off");
        }
    }
}
