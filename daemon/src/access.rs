//! The jobs' etcd users (etcd auth on): each job's workers connect as a user of their own whose
//! role reaches only that job's keys ([`ductile_cluster::access::job_grants`]), never as the
//! daemon or an agent. The leader makes the user when a job is submitted, records it under
//! `jobs/{job}/access` (fenced on its leader key and the spec's revision), hands it to the
//! job's nodes in their assignments, and removes it when the job has ended. A password is only
//! ever set from the record (written first, once), never anew for a job that has one.

use std::collections::{BTreeMap, BTreeSet};

use ductile_cluster::access::{job_grants, job_user, new_password, Secret, JOB_USER_PREFIX};
use ductile_cluster::kv::{Compare, LeaderKey, Op, Txn};
use ductile_cluster::records::JobAccess;
use ductile_cluster::store::{encode, Fence};
use ductile_cluster::Store;

use crate::reconcile::JobObs;

/// Whether a job needs its etcd user: submitted and not ended (a job asked to stop keeps it
/// until its workers are gone and it has ended).
fn needs_user(obs: &JobObs) -> bool {
    obs.spec.is_some() && !obs.status.as_ref().is_some_and(|s| s.state.is_terminal())
}

/// Bring the jobs' etcd users in line with `jobs`: make what is missing (and re-make a
/// recorded user someone deleted), remove the users of ended or deleted jobs. Returns
/// Ok(false) when a fenced write failed (another leader, or the job changed under us: the next
/// pass looks again); Err on an etcd error (nothing is assumed: the next pass tries again).
pub async fn sync_job_users(
    store: &Store,
    leader: &LeaderKey,
    jobs: &BTreeMap<String, JobObs>,
) -> ductile_cluster::Result<bool> {
    let k = &store.keys;
    let users: BTreeSet<String> = store.backend.users().await?.into_iter().collect();
    let mut all_written = true;
    for (name, obs) in jobs {
        let fence = Fence {
            leader: Some(leader),
            spec_revision: obs.spec_revision,
        };
        let user = job_user(name);
        match (&obs.access, needs_user(obs)) {
            (None, true) => {
                // the record first, the user after: a pass whose view of the job is older than
                // the record (the view has not caught up with a write of a moment ago) fails the
                // fenced write and leaves the user as it is. Setting the user first gave it a
                // new password that no record held, and locked the job's workers out for good.
                // A record whose user could not be made is made good by the next pass (below).
                let password = new_password()?;
                let rec = JobAccess {
                    user: user.clone(),
                    password: password.expose().to_string(),
                };
                let mut compares = fence.compares(k, name);
                compares.push(Compare::Absent(k.access(name)));
                let ok = store
                    .backend
                    .txn(Txn {
                        compares,
                        ops: vec![Op::put(k.access(name), encode(&rec))],
                    })
                    .await?
                    .succeeded;
                if ok {
                    store
                        .backend
                        .set_user(&user, &password, &job_grants(k, name))
                        .await?;
                    tracing::info!(job = %name, %user, "made the job's etcd user");
                }
                all_written &= ok;
            }
            (Some(a), true) if !users.contains(&a.user) => {
                tracing::warn!(job = %name, user = %a.user, "the job's etcd user is gone; making it again");
                store
                    .backend
                    .set_user(
                        &a.user,
                        &Secret::new(a.password.clone()),
                        &job_grants(k, name),
                    )
                    .await?;
            }
            (Some(a), false) => {
                // forget the record first: a user without a record is swept below, a record
                // without its user would leave a resubmitted job's workers locked out
                let mut compares = fence.compares(k, name);
                compares.push(Compare::Value(k.access(name), encode(a)));
                let ok = store
                    .backend
                    .txn(Txn {
                        compares,
                        ops: vec![Op::Delete {
                            key: k.access(name),
                        }],
                    })
                    .await?
                    .succeeded;
                all_written &= ok;
                if ok && store.backend.remove_user(&a.user).await? {
                    tracing::info!(job = %name, user = %a.user, "removed the ended job's etcd user");
                }
            }
            _ => {}
        }
    }
    // users of jobs that have ended (and lost their record) or are gone altogether
    for user in users.iter().filter(|u| u.starts_with(JOB_USER_PREFIX)) {
        let job = &user[JOB_USER_PREFIX.len()..];
        let keep = jobs
            .get(job)
            .is_some_and(|o| needs_user(o) || o.access.is_some());
        if !keep && store.backend.remove_user(user).await? {
            tracing::info!(job = %job, %user, "removed the etcd user of a job that has ended");
        }
    }
    Ok(all_written)
}
