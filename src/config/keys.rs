//! [`Keys`]: a deserializer over the keys of the top-level map, under every type's load (aliases
//! and field names in errors) and under [`super::Lenient`] (the HF keys).

use std::fmt;

use serde::de::{
    self, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, SeqAccess, Visitor,
};

use super::lenient::skip_hf_key;

/// What [`Keys`] does with each key of the top-level map.
#[derive(Debug, Clone, Copy)]
pub(super) enum Mode {
    /// Renames each `(alias, name)` key to its name and prefixes a value's error with the name
    /// (`top_k: invalid type: floating point ...`).
    Named(&'static [(&'static str, &'static str)]),
    /// Drops the HF keys of [`super::HF_IGNORED_KEYS`] and [`super::HF_NEUTRAL_KEYS`].
    SkipHf,
}

/// A deserializer whose top-level map has its keys handled by a [`Mode`]; the values, nested
/// maps included, reach the inner deserializer unchanged.
pub(super) struct Keys<D>(pub(super) D, pub(super) Mode);

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Keys<D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_any(KeysVisitor(v, self.1))
    }

    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_map(KeysVisitor(v, self.1))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, D::Error> {
        self.0
            .deserialize_struct(name, fields, KeysVisitor(v, self.1))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct enum identifier
        ignored_any
    }
}

/// Passes the inner visitor a [`KeysMap`].
struct KeysVisitor<V>(V, Mode);

impl<'de, V: Visitor<'de>> Visitor<'de> for KeysVisitor<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.0.visit_map(KeysMap {
            map,
            mode: self.1,
            key: String::new(),
        })
    }

    /// A derived struct also loads from a list of its fields in order; [`super::Lenient`] takes
    /// maps only.
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        match self.1 {
            Mode::Named(_) => self.0.visit_seq(seq),
            Mode::SkipHf => Err(de::Error::invalid_type(de::Unexpected::Seq, &self)),
        }
    }
}

/// The map of [`Keys`]; `key` is the last key passed on.
struct KeysMap<A> {
    map: A,
    mode: Mode,
    key: String,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for KeysMap<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        while let Some(key) = self.map.next_key::<String>()? {
            self.key = match self.mode {
                Mode::Named(aliases) => match aliases.iter().find(|(alias, _)| *alias == key) {
                    Some((_, name)) => name.to_string(),
                    None => key,
                },
                Mode::SkipHf if skip_hf_key(&key, &mut self.map)? => continue,
                Mode::SkipHf => key,
            };
            return seed
                .deserialize(self.key.as_str().into_deserializer())
                .map(Some);
        }
        Ok(None)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        let value = self.map.next_value_seed(seed);
        match self.mode {
            Mode::Named(_) => {
                value.map_err(|e| de::Error::custom(format_args!("{}: {e}", self.key)))
            }
            Mode::SkipHf => value,
        }
    }
}

/// `Serialize` and `Deserialize` for a type that derives them with `#[serde(remote = "Self")]`
/// (serde's way to run code around a derived implementation, which the derive then emits as
/// inherent functions): the load goes through [`Keys`] in [`Mode::Named`] with the type's
/// aliases, then through the type's check (`fn(&T) -> Result<(), impl Display>`), if any.
macro_rules! named_serde {
    ($ty:ty, $aliases:expr $(, $check:expr)?) => {
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                <$ty>::serialize(self, s)
            }
        }

        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                use $crate::config::keys::{Keys, Mode};
                let value = <$ty>::deserialize(Keys(d, Mode::Named($aliases)))?;
                $($check(&value).map_err(serde::de::Error::custom)?;)?
                Ok(value)
            }
        }
    };
}
pub(super) use named_serde;
