//! A background thread started on first use and joined by its owner.

use std::sync::OnceLock;
use std::thread::JoinHandle;

/// A thread that its owner starts when first needed and joins when it goes (after telling the
/// thread to stop).
#[derive(Default)]
pub(crate) struct OwnedThread {
    /// `None` inside when the thread could not be started.
    handle: OnceLock<Option<JoinHandle<()>>>,
}

impl OwnedThread {
    /// Starts the body `make` gives as the thread `name` unless it was started already (then
    /// `make` is not called); whether it runs.
    pub(crate) fn start_once<F: FnOnce() + Send + 'static>(
        &self,
        name: &str,
        make: impl FnOnce() -> F,
    ) -> bool {
        self.handle
            .get_or_init(|| {
                std::thread::Builder::new()
                    .name(name.to_owned())
                    .spawn(make())
                    .map_err(
                        |e| tracing::error!(error = %e, thread = name, "cannot start a thread"),
                    )
                    .ok()
            })
            .is_some()
    }

    /// Waits for the thread to end, if it was started; the caller has told it to stop.
    pub(crate) fn join(&mut self) {
        if let Some(Some(handle)) = self.handle.take() {
            let _ = handle.join();
        }
    }
}
