//! Each `MatMulTiling` setting really moves the quantized split (the bits never move: see
//! `tests/tiling.rs`): tasks are counted and measured on the plans themselves.

use super::{plan, tile_task_m, MatMulTiling, Task, TILE_TASK_N};
use crate::gemm::tiling_tests::{cover, in_pool};
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

#[test]
fn a_decode_splits_last_tasks_shrink_so_the_threads_finish_together() {
    // Q8_0 [4096, 2048]: rows of 2,176 bytes, 8.9 MB; 2 threads x 8 tasks of 256 rows.
    let (n, k) = (4096, 2048);
    let bytes = vec![0u8; n * DType::Q8_0.bytes_for(k).unwrap()];
    let w = WeightMat::new(DType::Q8_0, n, k, &bytes).unwrap();
    let rows = |threads: usize, ws: &[WeightMat<'_>], tiling: MatMulTiling| -> Vec<usize> {
        let tasks = in_pool(threads, || plan(ws, 1, 5, false, &tiling));
        for (mat, _) in ws.iter().enumerate() {
            let mine: Vec<Task> = tasks.iter().filter(|t| t.mat == mat).copied().collect();
            shape(&mine, n, 1);
        }
        tasks.iter().map(|t| t.j1 - t.j0).collect()
    };
    let guided = rows(2, &[w], MatMulTiling::default());
    assert!(guided.windows(2).all(|p| p[0] >= p[1]), "tasks grow: {guided:?}");
    // 256-row tasks until the last 1,024 rows (2 x threads tasks), then a quarter of what is
    // left, in whole 4-row tiles, down to the least 32 KiB (15 rows, so 16) and the rest.
    assert_eq!(&guided[..13], &[256; 13]);
    assert_eq!(guided[13], 192, "{guided:?}");
    assert!(guided[guided.len() - 2] == 16 && guided[guided.len() - 1] <= 16, "{guided:?}");

    // Over two matrices (a fused q/k/v: twice the bytes, so tasks of 484 rows, about 1 MiB)
    // only the second's last tasks shrink: the first's are full but for its remainder.
    let two = rows(2, &[w, w], MatMulTiling::default());
    assert_eq!(&two[..9], &[484, 484, 484, 484, 484, 484, 484, 484, 4096 - 8 * 484], "{two:?}");
    assert!(two[9..].windows(2).all(|p| p[0] >= p[1]) && two.last() <= Some(&16), "{two:?}");

    // One thread, or a set task count, gives even tasks.
    let one = rows(1, &[w], MatMulTiling::default());
    assert!(one[..one.len() - 1].iter().all(|&r| r == one[0]), "{one:?}");
    let set = MatMulTiling { tasks_per_thread: Some(8), ..MatMulTiling::default() };
    assert_eq!(rows(2, &[w], set), vec![256; 16]);
}
