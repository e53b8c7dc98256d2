//! Each `MatMulTiling` setting really moves the dense split (the bits never move: see
//! `tests/tiling.rs`): items are counted and measured on the plans themselves.

use super::{packed_tasks, plan_items, plan_items_tiled, Isa, Item, MatMulTiling};

pub(crate) fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

/// (count, widest, tallest) of rectangles `(i0, i1, j0, j1)`, after checking they cover the
/// `[m, n]` output exactly once.
pub(crate) fn cover(rects: &[(usize, usize, usize, usize)], n: usize, m: usize) -> (usize, usize, usize) {
    let mut seen = vec![0u8; n * m];
    for &(i0, i1, j0, j1) in rects {
        for i in i0..i1 {
            for j in j0..j1 {
                seen[i * n + j] += 1;
            }
        }
    }
    assert!(seen.iter().all(|&c| c == 1), "the work does not cover [{m}, {n}] exactly once: {rects:?}");
    let wide = rects.iter().map(|r| r.3 - r.2).max().unwrap_or(0);
    let tall = rects.iter().map(|r| r.1 - r.0).max().unwrap_or(0);
    (rects.len(), wide, tall)
}

fn shape(items: &[Item], n: usize, m: usize) -> (usize, usize, usize) {
    cover(&items.iter().map(|t| (t.i0, t.i1, t.j0, t.j1)).collect::<Vec<_>>(), n, m)
}

#[test]
fn every_tunable_moves_the_dense_split() {
    let (n, m, k) = (100, 40, 200);
    let t = |panel_rows, act_rows, tasks_per_thread| MatMulTiling {
        panel_rows,
        act_rows,
        tasks_per_thread,
        decode_task_min_bytes: None,
    };
    in_pool(2, || {
        let run = |tiling: MatMulTiling| shape(&plan_items_tiled(&[n], m, k, Isa::Scalar, &tiling), n, m);
        // 800,000 multiply-adds: 3 items of at least 2^18 (under 2 threads x 4), 40 columns each.
        assert_eq!(run(MatMulTiling::default()), (3, 40, 40));
        assert_eq!(shape(&plan_items(&[n], m, k, Isa::Scalar), n, m), (3, 40, 40));
        assert_eq!(run(t(Some(16), None, None)), (7, 16, 40));
        assert_eq!(run(t(None, Some(8), None)), (3 * 5, 40, 8));
        assert_eq!(run(t(Some(64), Some(13), None)), (2 * 4, 64, 13));
        // One item per thread: 2 items of 56 columns (multiples of 8).
        assert_eq!(run(t(None, None, Some(1))), (2, 56, 40));
        // 64 per thread is capped by the least work per item, as the default is.
        assert_eq!(run(t(None, None, Some(64))), (3, 40, 40));

        // Decode (m = 1, below the register tile): 8 items per thread by default, 2 x 8
        // items of 256 columns out of 4096 (16.8M multiply-adds allow 64); 4 per thread
        // when set.
        let (n, k) = (4096, 4096);
        let run = |tiling: MatMulTiling| shape(&plan_items_tiled(&[n], 1, k, Isa::Scalar, &tiling), n, 1);
        assert_eq!(run(MatMulTiling::default()), (16, 256, 1));
        assert_eq!(run(t(None, None, Some(4))), (8, 512, 1));
    });
}

#[test]
fn a_dense_decode_splits_last_panels_shrink_unless_the_tasks_are_set() {
    // F16 [4096, 2048] in 16-row panels of 64 KiB: 256 panels, 2 threads x 8 tasks, at most
    // 512 KiB (8 panels) a task.
    let (n, k) = (4096, 2048);
    let panels = |tiling: MatMulTiling| -> Vec<usize> {
        let tasks = in_pool(2, || packed_tasks(&[n], 1, k, &tiling, 1));
        let rects: Vec<_> = tasks.iter().map(|t| (t.i0, t.i1, t.p0, t.p1)).collect();
        cover(&rects, 256, 1);
        tasks.iter().map(|t| t.p1 - t.p0).collect()
    };
    let guided = panels(MatMulTiling::default());
    assert!(guided.windows(2).all(|w| w[0] >= w[1]), "tasks grow: {guided:?}");
    // Full tasks until the last 2 x threads tasks' worth (32 panels), then shrinking to one.
    assert_eq!(guided.iter().filter(|&&p| p == 8).count(), 29, "{guided:?}");
    assert_eq!(guided.last(), Some(&1), "{guided:?}");
    let set = MatMulTiling { tasks_per_thread: Some(8), ..MatMulTiling::default() };
    assert_eq!(panels(set), vec![8; 32]);
}
