//! Each `MatMulTiling` setting really moves the quantized split (the bits never move: see
//! `tests/tiling.rs`): tasks are counted and measured on the plans themselves.

use super::{plan, tile_task_m, MatMulTiling, Task, TILE_TASK_N};
use crate::matmul::tiling_tests::{cover, in_pool};
use crate::{DType, WeightMat};

/// (tasks, widest, tallest), after checking they cover the `[m, n]` output exactly once.
fn shape(tasks: &[Task], n: usize, m: usize) -> (usize, usize, usize) {
    cover(&tasks.iter().map(|t| (t.i0, t.i1, t.j0, t.j1)).collect::<Vec<_>>(), n, m)
}

#[test]
fn every_tunable_moves_the_quantized_split() {
    let (n, k) = (100, 512);
    let bytes = vec![0u8; n * DType::Q8_0.bytes_for(k).unwrap()];
    let w = WeightMat::new(DType::Q8_0, n, k, &bytes).unwrap();
    let t = |panel_rows, act_rows, tasks_per_thread, decode_task_min_bytes| MatMulTiling {
        panel_rows,
        act_rows,
        tasks_per_thread,
        decode_task_min_bytes,
    };
    in_pool(2, || {
        // Tiled (m = 97 from 5 rows on): panels of 48 weight rows, 96 activation rows by default.
        let m = 97;
        let run = |tiling: MatMulTiling| shape(&plan(&[w], m, 5, false, &tiling), n, m);
        assert_eq!(tile_task_m(k), 96);
        assert_eq!(run(MatMulTiling::default()), (3 * 2, TILE_TASK_N, 96));
        assert_eq!(run(t(Some(32), None, None, None)), (4 * 2, 32, 96));
        assert_eq!(run(t(None, Some(10), None, None)), (3 * 10, 48, 10));
        assert_eq!(run(t(Some(16), Some(1), None, None)), (7 * 97, 16, 1));
        // Fast precision keeps 1024 activation rows per task unless told.
        assert_eq!(shape(&plan(&[w], m, 6, true, &MatMulTiling::default()), n, m), (3, 48, 97));
        assert_eq!(shape(&plan(&[w], m, 6, true, &t(None, Some(20), None, None)), n, m), (3 * 5, 48, 20));

        // Decode (m = 1): 54,400 weight bytes over 2 threads x 16 tasks, at least 32 KiB a
        // task: 60 rows (of 544 bytes) a task, so 2 tasks.
        let m = 1;
        let run = |tiling: MatMulTiling| shape(&plan(&[w], m, 5, false, &tiling), n, m);
        assert_eq!(run(MatMulTiling::default()), (2, 60, 1));
        // A smaller least size lets the tasks per thread show: 16 (the decode default) give
        // 1,700 bytes, below the least 4,096 (8 rows a task); 4 give 6,800 bytes, 12 rows.
        assert_eq!(run(t(None, None, None, Some(4096))), (13, 8, 1));
        assert_eq!(run(t(None, None, Some(4), Some(4096))), (9, 12, 1));
        // One task per thread: 27,200 bytes, 52 rows (a multiple of 4).
        assert_eq!(run(t(None, None, Some(1), Some(4096))), (2, 52, 1));
        // 64 tasks per thread fall to the least size: 4,096 bytes, 8 rows.
        assert_eq!(run(t(None, None, Some(64), Some(4096))), (13, 8, 1));
        // A panel fixes the rows whatever the bytes.
        assert_eq!(run(t(Some(16), None, Some(64), Some(4096))), (7, 16, 1));
        // Activation rows split decode too.
        assert_eq!(shape(&plan(&[w], 3, 5, false, &t(None, Some(1), None, None)), n, 3), (6, 60, 1));
    });
}
