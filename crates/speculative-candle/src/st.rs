//! Byte-stable safetensors files: `safetensors::serialize` writes the metadata map in a
//! `HashMap`'s iteration order, which changes from run to run, so two writes of the same
//! tensors differ in their header. [`serialize`] sorts the header's keys (the data bytes and
//! their offsets are unchanged), so a file depends only on its contents.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

/// One entry of a safetensors header.
#[derive(Serialize)]
#[serde(untagged)]
enum Entry {
    /// `__metadata__`: string to string, sorted.
    Meta(BTreeMap<String, String>),
    /// A tensor's dtype, shape and offsets (a fixed key order already).
    Tensor(serde_json::Value),
}

/// `safetensors::serialize` of `views` and `meta` with the header's keys (tensor names and
/// metadata keys) in sorted order.
///
/// # Errors
/// The message of a safetensors or JSON failure.
pub(crate) fn serialize<V: safetensors::View>(
    views: Vec<(String, V)>,
    meta: HashMap<String, String>,
) -> Result<Vec<u8>, String> {
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| e.to_string())?;
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
        .filter(|&n| 8 + n <= bytes.len())
        .ok_or("safetensors: short header")?;
    let top: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).map_err(|e| e.to_string())?;
    let mut sorted = BTreeMap::new();
    for (k, v) in top {
        let e = if k == "__metadata__" {
            Entry::Meta(serde_json::from_value(v).map_err(|e| e.to_string())?)
        } else {
            Entry::Tensor(v)
        };
        sorted.insert(k, e);
    }
    let mut header = serde_json::to_string(&sorted).map_err(|e| e.to_string())?;
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut out = Vec::with_capacity(8 + header.len() + bytes.len() - 8 - n);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::{Dtype, TensorView};

    fn write(order: &[usize]) -> Vec<u8> {
        let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let views = vec![
            (
                "b".to_string(),
                TensorView::new(Dtype::U32, vec![1], &data[..4]).unwrap(),
            ),
            (
                "a".to_string(),
                TensorView::new(Dtype::U8, vec![4], &data[4..]).unwrap(),
            ),
        ];
        let keys = ["k1", "k2", "k3", "k4", "k5", "k6"];
        let meta = order
            .iter()
            .map(|&i| (keys[i].to_string(), format!("v{i}")))
            .collect();
        serialize(views, meta).unwrap()
    }

    #[test]
    fn header_is_sorted_and_the_file_reads_back() {
        let a = write(&[0, 1, 2, 3, 4, 5]);
        for _ in 0..8 {
            assert_eq!(write(&[5, 3, 1, 0, 2, 4]), a);
        }
        let st = safetensors::SafeTensors::deserialize(&a).unwrap();
        assert_eq!(st.tensor("b").unwrap().data(), &[1, 2, 3, 4]);
        assert_eq!(st.tensor("a").unwrap().data(), &[5, 6, 7, 8]);
        let (_, h) = safetensors::SafeTensors::read_metadata(&a).unwrap();
        assert_eq!(h.metadata().as_ref().unwrap()["k3"], "v2");
    }
}
