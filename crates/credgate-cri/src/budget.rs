//! What the proxy may hold of the messages it reads whole (`PullImage` and `RemoveImage`
//! requests and answers, its own `ListImages`): bytes are taken from two budgets as they
//! arrive, the caller's connection's and the whole proxy's, and given back when the call's
//! answer has been sent or dropped. A call that finds no room is refused with
//! RESOURCE_EXHAUSTED at once, so a caller that opens many streams and stops sending near the
//! end of each holds at most its connection's share, and all callers together the proxy's.

use std::sync::Arc;

use http_body::Body;
use http_body_util::BodyExt;
use hyper::body::Bytes;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// All that every caller's calls may hold at once.
pub const PROXY_BYTES: usize = 64 << 20;
/// All that one connection's calls may hold at once: a kubelet's pulls are a few KiB each.
pub const CONNECTION_BYTES: usize = 4 << 20;

/// The proxy's budget, shared by every connection, and the gauge of what is taken from it
/// (`credgate_cri_held_bytes`: the agent's own account of what the proxy holds).
#[derive(Clone)]
pub struct ProxyBudget {
    budget: Arc<Semaphore>,
    held: Gauge,
}

/// The two budgets a connection's calls draw from.
#[derive(Clone)]
pub struct Budgets {
    proxy: ProxyBudget,
    connection: Arc<Semaphore>,
}

/// Bytes taken from both budgets, given back on drop.
#[derive(Default)]
pub struct Taken {
    proxy: Option<OwnedSemaphorePermit>,
    connection: Option<OwnedSemaphorePermit>,
    /// What is counted in the proxy's gauge, given back with the permits.
    held: Option<(Gauge, i64)>,
}

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some((gauge, n)) = &self.held {
            gauge.dec_by(*n);
        }
    }
}

/// Why a body was not read whole.
pub enum Unread {
    /// Above the call's own limit.
    TooLarge,
    /// No room left in a budget.
    Exhausted,
    /// The body ended with an error.
    Broken,
}

impl Budgets {
    /// The proxy's budget, shared by every connection; what is taken is counted in `held`.
    pub fn proxy(held: Gauge) -> ProxyBudget {
        ProxyBudget {
            budget: Arc::new(Semaphore::new(PROXY_BYTES)),
            held,
        }
    }

    /// A new connection's budgets, drawing from `proxy` as well.
    pub fn connection(proxy: &ProxyBudget, bytes: usize) -> Budgets {
        Budgets {
            proxy: proxy.clone(),
            connection: Arc::new(Semaphore::new(bytes)),
        }
    }

    fn take(&self, n: usize, taken: &mut Taken) -> Result<(), Unread> {
        let n = u32::try_from(n).map_err(|_| Unread::TooLarge)?;
        let connection = self
            .connection
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| Unread::Exhausted)?;
        let proxy = self
            .proxy
            .budget
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| Unread::Exhausted)?;
        merge(&mut taken.connection, connection);
        merge(&mut taken.proxy, proxy);
        let n = i64::from(n);
        self.proxy.held.inc_by(n);
        match &mut taken.held {
            Some((_, held)) => *held += n,
            None => taken.held = Some((self.proxy.held.clone(), n)),
        }
        Ok(())
    }
}

fn merge(into: &mut Option<OwnedSemaphorePermit>, more: OwnedSemaphorePermit) {
    match into {
        Some(p) => p.merge(more),
        None => *into = Some(more),
    }
}

/// A body read whole: its bytes and trailers, and what they took of the budgets.
pub struct Collected {
    pub data: Bytes,
    pub trailers: Option<hyper::HeaderMap>,
    pub taken: Taken,
}

/// Reads `body` whole, at most `limit` bytes, taking each frame's bytes from `budgets` before
/// keeping them.
pub async fn collect<B>(mut body: B, limit: usize, budgets: &Budgets) -> Result<Collected, Unread>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut data = Vec::new();
    let mut trailers = None;
    let mut taken = Taken::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| Unread::Broken)?;
        match frame.into_data() {
            Ok(chunk) => {
                if data.len() + chunk.len() > limit {
                    return Err(Unread::TooLarge);
                }
                budgets.take(chunk.len(), &mut taken)?;
                data.extend_from_slice(&chunk);
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers = Some(t);
                }
            }
        }
    }
    Ok(Collected {
        data: Bytes::from(data),
        trailers,
        taken,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    #[tokio::test]
    async fn bodies_take_from_both_budgets_and_give_back_on_drop() {
        let held = Gauge::default();
        let proxy = ProxyBudget {
            budget: Arc::new(Semaphore::new(100)),
            held: held.clone(),
        };
        let a = Budgets::connection(&proxy, 60);
        let b = Budgets::connection(&proxy, 60);
        let first = collect(Full::new(Bytes::from(vec![1u8; 50])), 1000, &a)
            .await
            .ok()
            .unwrap();
        assert_eq!(first.data.len(), 50);
        // The connection's own budget is nearly spent...
        assert!(matches!(
            collect(Full::new(Bytes::from(vec![1u8; 20])), 1000, &a).await,
            Err(Unread::Exhausted)
        ));
        // ...and another connection may take what the proxy has left.
        let second = collect(Full::new(Bytes::from(vec![1u8; 50])), 1000, &b)
            .await
            .ok()
            .unwrap();
        assert_eq!(held.get(), 100, "the gauge counts what is held");
        assert!(matches!(
            collect(Full::new(Bytes::from(vec![1u8; 5])), 1000, &b).await,
            Err(Unread::Exhausted)
        ));
        assert!(matches!(
            collect(Full::new(Bytes::from(vec![1u8; 50])), 10, &b).await,
            Err(Unread::TooLarge)
        ));
        drop((first, second));
        assert_eq!(proxy.budget.available_permits(), 100);
        assert_eq!(held.get(), 0, "and what is given back");
    }
}
