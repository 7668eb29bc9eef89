//! Helpers of the crate's unit tests only: a task to make records from, the field names serde
//! reads into a type, and the tables of a Markdown page, so tests can hold the docs to the code.

/// A task of user `u` with the demo model `policy` and the default budget.
pub fn task() -> crate::store::NewTask {
    let policy = crate::model::ModelProfile::parse("policy", None).expect("a model");
    crate::store::NewTask::of("u", "g", policy)
}

/// The fields serde reads into `T`, captured from the derive's own list: a deserializer that
/// answers nothing but the struct's field names. Sorted.
pub fn fields_of<T: serde::de::DeserializeOwned>() -> Vec<&'static str> {
    use serde::de::{Error as _, Visitor, value::Error};
    struct Capture<'a>(&'a mut &'static [&'static str]);
    impl<'de> serde::Deserializer<'de> for Capture<'_> {
        type Error = Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
            Err(Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Error> {
            *self.0 = fields;
            Err(Error::custom("captured"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Capture(&mut fields));
    let mut v = fields.to_vec();
    v.sort_unstable();
    v
}

/// A page of `docs/` (or any file of the repository), by its path from the repository root.
pub fn page(path: &str) -> String {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// The rows of the Markdown tables under each heading of `page`: heading text, then each
/// row's cells (the header row and the separator left out).
pub fn tables(page: &str) -> Vec<(String, Vec<Vec<String>>)> {
    let mut out: Vec<(String, Vec<Vec<String>>)> = Vec::new();
    let mut header_seen = false;
    for line in page.lines() {
        if let Some(h) = line.strip_prefix('#') {
            out.push((h.trim_start_matches('#').trim().to_string(), Vec::new()));
            header_seen = false;
            continue;
        }
        let Some(row) = line.strip_prefix('|') else {
            header_seen = false;
            continue;
        };
        if !header_seen {
            header_seen = true;
            continue;
        }
        if row.trim_start().starts_with("---") || row.trim_start().starts_with(" ---") {
            continue;
        }
        let cells = row
            .trim_end()
            .trim_end_matches('|')
            .split(" | ")
            .map(|c| c.trim().to_string())
            .collect();
        if let Some((_, rows)) = out.last_mut() {
            rows.push(cells);
        }
    }
    out
}

/// The names in backticks of a table cell: "`a`, `b`" gives a and b.
pub fn code_names(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}
