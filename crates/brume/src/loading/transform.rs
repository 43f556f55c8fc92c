//! How a stored tensor becomes the tensor a module asks for.
//!
//! Most checkpoints store each parameter under its own name in the layout the
//! model wants. Some do not: the original LDM single-file layout fuses the
//! OpenCLIP q/k/v projections into one `in_proj_weight` and stores the VAE's
//! attention projections as 1x1 convolutions. A [`Transform`] records the cheap,
//! view-like fix-up applied at load time so the stored bytes are never rewritten.

/// A load-time view of a stored tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transform {
    /// Use the tensor as stored.
    Identity,
    /// Take rows `start..start + len` of dimension 0 (e.g. one of q/k/v from a
    /// fused `in_proj_weight` of shape `[3 * d, d]`).
    Rows { start: usize, len: usize },
    /// Reinterpret with another shape of the same element count (e.g. a 1x1
    /// conv weight `[c, c, 1, 1]` used as a linear weight `[c, c]`).
    Reshape(Vec<usize>),
    /// `Rows` followed by `Reshape`.
    RowsThenReshape { start: usize, len: usize, shape: Vec<usize> },
}

impl Transform {
    /// The shape this transform produces from a stored shape, or `None` when
    /// the stored shape cannot support it.
    pub fn output_shape(&self, stored: &[usize]) -> Option<Vec<usize>> {
        let rows = |shape: &[usize], start: usize, len: usize| -> Option<Vec<usize>> {
            let first = *shape.first()?;
            if start.checked_add(len)? > first {
                return None;
            }
            let mut out = shape.to_vec();
            out[0] = len;
            Some(out)
        };
        let reshape = |shape: &[usize], to: &[usize]| -> Option<Vec<usize>> {
            let n: usize = shape.iter().product();
            let m: usize = to.iter().product();
            (n == m).then(|| to.to_vec())
        };
        match self {
            Transform::Identity => Some(stored.to_vec()),
            Transform::Rows { start, len } => rows(stored, *start, *len),
            Transform::Reshape(to) => reshape(stored, to),
            Transform::RowsThenReshape { start, len, shape } => {
                let r = rows(stored, *start, *len)?;
                reshape(&r, shape)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        assert_eq!(Transform::Identity.output_shape(&[2, 3]), Some(vec![2, 3]));
        let r = Transform::Rows { start: 4, len: 4 };
        assert_eq!(r.output_shape(&[12, 4]), Some(vec![4, 4]));
        assert_eq!(Transform::Rows { start: 10, len: 4 }.output_shape(&[12, 4]), None);
        assert_eq!(Transform::Reshape(vec![8, 8]).output_shape(&[8, 8, 1, 1]), Some(vec![8, 8]));
        assert_eq!(Transform::Reshape(vec![8, 9]).output_shape(&[8, 8, 1, 1]), None);
    }
}
