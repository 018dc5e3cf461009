//! The [`DataSource`](crate::DataSource) methods sources write alike, written once.

/// Methods for a source's `impl DataSource`:
/// - `source_methods!(fields)`: `vocab_size` and `describe` from the source's fields
///   `vocab_size` and `description`;
/// - `source_methods!(wraps inner)`: `describe` from the field `description`, and
///   `vocab_size`, `encode` and `decode` passed to the source in the field `inner`.
macro_rules! source_methods {
    (fields) => {
        fn vocab_size(&self) -> usize {
            self.vocab_size
        }

        fn describe(&self) -> String {
            self.description.clone()
        }
    };
    (wraps $inner:ident) => {
        fn vocab_size(&self) -> usize {
            self.$inner.vocab_size()
        }

        fn describe(&self) -> String {
            self.description.clone()
        }

        fn encode(&self, text: &str) -> $crate::Result<Vec<u32>> {
            self.$inner.encode(text)
        }

        fn decode(&self, ids: &[u32]) -> $crate::Result<String> {
            self.$inner.decode(ids)
        }
    };
}
