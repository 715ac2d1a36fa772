"""Train with several towers and synchronous gradient averaging, in one process, on mpitf.

The original: ``tutorials/image/cifar10/cifar10_multi_gpu_train.py`` of TensorFlow's
models repository (The TensorFlow Authors, Apache License 2.0), with the constants of its
``cifar10.py`` and the precision line of its ``cifar10_eval.py``. This program keeps its
flags, its loop and its log line; every line that differs says why in a comment (``TF:``
names what the original calls there).

    python cifar10_multi_gpu_train.py --num_gpus=2 --max_steps=100 --train_dir=/tmp/t

What changed besides the imports: the data are the digits set (8 x 8 gray images) in place
of CIFAR-10 (32 x 32 colour, downloaded), and the model mpitf's reference CNN; mpitf has no
graph, so ``tower_loss`` on ``/gpu:i`` for each ``i`` and ``average_gradients`` are one
call, ``Towers.loss_and_grads`` (each tower's gradient on its device, their mean on the
first), and ``opt.apply_gradients`` is ``Towers.apply_locally``. ``allow_soft_placement``
means what it means in TensorFlow: without a GPU the towers run on the CPU.
"""

import argparse
import os
import shutil
import time
from datetime import datetime

import numpy as np

import mpitf  # TF: import tensorflow as tf; import cifar10
from mpitf.data.sharded import load_split
from mpitf.models import evaluate
from mpitf.worker.towers import Towers, tower_backend

# TF: cifar10.parser (--batch_size, --data_dir, --use_fp16) and this program's flags.
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch_size", type=int, default=128,
                    help="number of images to process in a batch (per tower)")
parser.add_argument("--data_dir", default=os.path.dirname(mpitf.default_data_path()),
                    help="directory holding digits.h5")
parser.add_argument("--use_fp16", action="store_true", help="train the model using fp16")
parser.add_argument("--train_dir", default="/tmp/cifar10_train",
                    help="directory where to write checkpoints")
parser.add_argument("--max_steps", type=int, default=1000000, help="number of batches to run")
parser.add_argument("--num_gpus", type=int, default=1, help="how many GPUs to use")
parser.add_argument("--log_device_placement", action="store_true",
                    help="whether to log device placement")

# cifar10.py's constants; the number of training examples is the digits set's.
NUM_EPOCHS_PER_DECAY = 350.0
LEARNING_RATE_DECAY_FACTOR = 0.1
INITIAL_LEARNING_RATE = 0.1
TOWER_NAME = "tower"


def train():
    """Train for a number of steps."""
    data_path = os.path.join(FLAGS.data_dir, "digits.h5")
    # TF: cifar10.distorted_inputs() and a prefetch queue; each step dequeues one batch
    # per tower, so a step reads batch_size * num_gpus examples.
    batch_queue = mpitf.ShardedDataset(data_path, "train",
                                       batch_size=FLAGS.batch_size * FLAGS.num_gpus)
    num_examples_per_epoch_for_train = batch_queue.total_samples  # TF: 50000 (CIFAR-10)

    # Calculate the learning rate schedule.
    num_batches_per_epoch = num_examples_per_epoch_for_train / FLAGS.batch_size
    decay_steps = int(num_batches_per_epoch * NUM_EPOCHS_PER_DECAY)

    # Decay the learning rate exponentially based on the number of steps.
    lr = mpitf.ExponentialDecay(INITIAL_LEARNING_RATE, decay_steps,
                                LEARNING_RATE_DECAY_FACTOR, staircase=True)

    # Create an optimizer that performs gradient descent.
    opt = mpitf.make_optimizer("sgd", lr)

    # TF: cifar10.inference(images) in every tower, its variables shared.
    model = mpitf.build_model("cnn", batch_queue.x_dim, batch_queue.num_classes,
                              batch_queue.image_shape,
                              dtype=np.float16 if FLAGS.use_fp16 else np.float32)
    # TF: for i in range(FLAGS.num_gpus): with tf.device('/gpu:%d' % i): tower_loss(...);
    # grads = average_gradients(tower_grads). One Towers object is that loop; the
    # soft placement of the session's ConfigProto goes to each tower's device.
    towers = Towers(model, [tower_backend("gpu", i, allow_soft_placement=True)
                            for i in range(FLAGS.num_gpus)])
    if FLAGS.log_device_placement:
        for i, be in enumerate(towers.backends):
            print("%s_%d: %s" % (TOWER_NAME, i, "gpu:%d" % be.device_id if be.is_gpu
                                 else "cpu"))

    # TF: sess.run(tf.global_variables_initializer()).
    params = towers.params
    for name, value in towers.init(np.random.default_rng(0)).items():
        towers.backends[0].to_device(value, out=params[name])
    slots = None  # the optimizer's slots, made on the first apply

    # TF: histogram summaries, the moving averages of the variables and the summary
    # writer are left out: this program trains alone, without a ps to keep averages.
    for step in range(FLAGS.max_steps):
        start_time = time.time()
        # TF: sess.run([train_op, loss]): the towers' mean gradient, then apply_gradients.
        loss_value = towers.loss_and_grads(params, batch_queue.next_batch(), towers.grads)
        slots = towers.apply_locally(opt, step, slots)
        duration = time.time() - start_time

        assert not np.isnan(loss_value), "Model diverged with loss = NaN"

        if step % 10 == 0:
            num_examples_per_step = FLAGS.batch_size * FLAGS.num_gpus
            examples_per_sec = num_examples_per_step / duration
            sec_per_batch = duration / FLAGS.num_gpus

            format_str = "%s: step %d, loss = %.2f (%.1f examples/sec; %.3f sec/batch)"
            print(format_str % (datetime.now(), step, loss_value, examples_per_sec,
                                sec_per_batch))

        # Save the model checkpoint periodically.
        if step % 1000 == 0 or (step + 1) == FLAGS.max_steps:
            checkpoint_path = os.path.join(FLAGS.train_dir, "model.ckpt")
            # TF: saver.save(sess, checkpoint_path, global_step=step); mpitf's checkpoints
            # are cut by ps tasks, so one process alone writes its variables as npz.
            np.savez("%s-%d.npz" % (checkpoint_path, step),
                     **{k: towers.backends[0].to_host(v) for k, v in params.items()})
    batch_queue.close()

    # TF: cifar10_eval.py, run separately on the checkpoint: precision @ 1 on the test set.
    x_test, y_test = load_split(data_path, "test")
    _, precision = evaluate(model, params, x_test, y_test)
    print("%s: precision @ 1 = %.3f" % (datetime.now(), precision))


def main(argv=None):
    if os.path.exists(FLAGS.train_dir):  # TF: tf.gfile.Exists / DeleteRecursively
        shutil.rmtree(FLAGS.train_dir)
    os.makedirs(FLAGS.train_dir)  # TF: tf.gfile.MakeDirs
    train()


if __name__ == "__main__":
    FLAGS = parser.parse_args()
    main()  # TF: tf.app.run()
