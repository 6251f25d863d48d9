"""A Keras `model.fit` under TensorFlow's `MultiWorkerMirroredStrategy`, written as TensorFlow's
multi-worker guide writes one: the world comes from `TF_CONFIG`, and
`BackupAndRestore` resumes an interrupted `fit` from its last backup. No line of it knows
ductile. Run it as a ductile `runtime = "tf"` job (ductile gives each generation's workers
`TF_CONFIG`), or by hand with `TF_CONFIG` set on each worker.

A small regression network on a seeded synthetic set, on CPU; the global batch stays
`--global_batch` at any world size (`tf.distribute` splits it over the workers). At the end
the chief (worker 0) writes `OUTPUT_DIR/final.json`: the optimizer's step count, the last
loss, and the weights' checksum.

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345"]}, "task": {"type": "worker", "index": 0}}' \
        python keras_fit.py --output_dir /tmp/fit
"""

import argparse
import hashlib
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

try:
    # Keras 2: what MultiWorkerMirroredStrategy's model.fit runs on (tf.keras under
    # TF_USE_LEGACY_KERAS=1)
    import tf_keras as keras
except ImportError:
    from tensorflow import keras


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--steps_per_epoch", type=int, default=100)
    p.add_argument("--global_batch", type=int, default=32)
    p.add_argument("--save_freq", type=int, default=20)
    p.add_argument("--step_sleep", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    chief = task.get("index", 0) == 0
    print(
        f"worker {task.get('index', 0)} of {strategy.num_replicas_in_sync}",
        flush=True,
    )

    rng = np.random.default_rng(a.seed)
    x = rng.normal(size=(8192, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1)) + 0.1 * rng.normal(size=(8192, 1))).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(a.global_batch).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = ds.with_options(options)

    with strategy.scope():
        keras.utils.set_random_seed(a.seed)
        model = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")

    callbacks = [
        keras.callbacks.BackupAndRestore(
            os.path.join(a.output_dir, "backup"), save_freq=a.save_freq
        )
    ]
    if a.step_sleep > 0:
        callbacks.append(
            keras.callbacks.LambdaCallback(on_train_batch_end=lambda *_: __import__("time").sleep(a.step_sleep))
        )
    history = model.fit(
        ds,
        epochs=a.epochs,
        steps_per_epoch=a.steps_per_epoch,
        callbacks=callbacks,
        verbose=2,
    )
    steps = int(model.optimizer.iterations.numpy())
    if chief:
        digest = hashlib.sha256()
        for w in model.get_weights():
            digest.update(np.ascontiguousarray(w).tobytes())
        with open(os.path.join(a.output_dir, "final.json"), "w") as f:
            json.dump(
                {
                    "steps": steps,
                    "loss": float(history.history["loss"][-1]),
                    "sha256": digest.hexdigest(),
                },
                f,
            )
    print(f"finished at step {steps}", flush=True)


if __name__ == "__main__":
    main()
