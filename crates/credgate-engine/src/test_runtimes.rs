//! `on_both_runtimes!`, shared by the unit tests of `exec` and the integration tests: each
//! named async test body runs on a current-thread runtime, where a plugin run waits through
//! the reactor, and on a multi-threaded one, where it first waits inline (`block_in_place`)
//! and falls back to the reactor after a few milliseconds.

macro_rules! on_both_runtimes {
    ($($name:ident),* $(,)?) => {
        $(mod $name {
            #[tokio::test]
            async fn current_thread() {
                super::$name().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn multi_thread() {
                super::$name().await
            }
        })*
    };
}
