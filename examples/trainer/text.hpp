#pragma once
// The example trainer's data: a few KB of prose shipped in the binary, and a batch sampler whose global batch is
// a pure function of (step, seed), so a run on 1 rank and a run on 4 ranks see the same bytes.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace trainer {

//! A batch of B rows of T+1 bytes: the inputs of row b are tokens[b*(T+1) + t], its targets tokens[b*(T+1) + t+1]
//! for t in [0, T).
struct batch {
  std::vector<std::uint8_t> tokens;
  int B = 0;
  int T = 0;

  int rows() const { return B * T; }  // positions: the rows of every [B*T, width] activation
  std::uint8_t input(int b, int t) const { return tokens[static_cast<std::size_t>(b) * (T + 1) + t]; }
  std::uint8_t target(int b, int t) const { return tokens[static_cast<std::size_t>(b) * (T + 1) + t + 1]; }
};

//! The training text: English prose about sharded training, written for this example (no outside corpus), about
//! 4 KB, so a small model can visibly learn its spelling and common words in a few dozen steps.
inline std::string training_text() {
  return
      "A model that does not fit on one machine can still be trained by many machines together. Each of them "
      "keeps only a shard of every parameter, a slice that is its own to store and to update. When a layer is "
      "about to run, the machines gather the shards of that layer into a whole, use it, and drop it again, so the "
      "memory that a layer needs is borrowed only for as long as the layer is working.\n"
      "The backward pass walks the layers in the opposite order. It gathers each layer once more, computes the "
      "gradient of the loss with respect to the inputs and to the weights, and then reduces the weight gradients "
      "so that every machine receives the sum of the pieces that belong to its own shard. The optimizer then "
      "updates the shard in place, and nobody ever holds the whole model at rest.\n"
      "Data parallel training works because the loss is an average. If every machine takes an equal share of the "
      "batch and averages its loss over its own positions, then the average of the gradients over the machines "
      "is the gradient of the whole batch. A careful trainer checks this: one machine and four machines should "
      "walk the same path, step by step, up to the rounding of the sums.\n"
      "Communication is the price of this arrangement. A gather moves every parameter across the network once in "
      "the forward pass and once in the backward pass, and a reduce scatter moves every gradient once. On a slow "
      "link the machines wait; on a fast one they hardly notice. So the trainer prefetches the next layer while "
      "the current one computes, and it keeps the number of layers in flight small, so that the borrowed memory "
      "stays bounded.\n"
      "The words of a language model are bytes here. The model sees a window of text, one byte after another, and "
      "at every position it guesses the byte that comes next. At first it guesses every byte with the same odds, "
      "and its loss is the logarithm of two hundred and fifty six. Soon it learns that spaces follow words, that "
      "the letter e is common and that a q is rare, and the loss falls. Later it learns whole words: the, and, "
      "gradient, shard, machine, layer, memory.\n"
      "Rounding is the quiet enemy of a distributed run. Sums taken in a different order give slightly different "
      "answers, and a reduction over four machines adds its terms in a different order than a single machine "
      "does. The difference is small, a few units in the last place, but it is real, and a test that demands "
      "exact equality between the two runs will fail for no good reason. A tolerance suited to single precision "
      "is the honest choice.\n"
      "Checkpoints are written shard by shard. Each machine saves the slice it owns, together with a small note "
      "that says which slice it is and how large the whole parameter was. To resume on a different number of "
      "machines, the trainer reads the notes, puts the slices back together, and cuts them again along the new "
      "boundaries.\n"
      "When a machine fails, the others notice that a message is late. They wait a little, then they give up, "
      "report which peer went silent, and stop cleanly, so that the job can be started again from the last "
      "checkpoint. A trainer that hangs forever is worse than one that fails loudly.\n"
      "The same ideas carry from two machines to two thousand. What changes is the care that must be taken with "
      "the network: the order of messages, the size of each transfer, and the overlap of communication with "
      "compute. Small models teach the method; large models repay it.\n";
}

namespace detail {
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace detail

//! Rows [first_row, first_row + rows) of the global batch of B rows for `step`; rows = -1 means up to B. Each
//! global row is a window of T+1 bytes starting at an offset hashed from (seed, step, row), so any split of the
//! rows among ranks reproduces the global batch exactly.
inline batch make_batch(const std::string& text, int B, int T, std::uint64_t step, std::uint64_t seed,
                        int first_row = 0, int rows = -1) {
  if (rows < 0) rows = B - first_row;
  if (B <= 0 || T <= 0 || first_row < 0 || rows < 0 || first_row + rows > B)
    throw std::invalid_argument("make_batch: rows [first_row, first_row+rows) must lie in [0, B) with B, T > 0");
  if (text.size() < static_cast<std::size_t>(T) + 1)
    throw std::invalid_argument("make_batch: text shorter than T+1 bytes");
  const std::uint64_t starts = text.size() - static_cast<std::size_t>(T);  // valid window starts
  batch out;
  out.B = rows;
  out.T = T;
  out.tokens.resize(static_cast<std::size_t>(rows) * (T + 1));
  for (int r = 0; r < rows; ++r) {
    const std::uint64_t row = static_cast<std::uint64_t>(first_row + r);
    const std::uint64_t h = detail::splitmix64(detail::splitmix64(detail::splitmix64(seed) ^ step) ^ row);
    const std::size_t start = static_cast<std::size_t>(h % starts);
    for (int t = 0; t <= T; ++t)
      out.tokens[static_cast<std::size_t>(r) * (T + 1) + t] = static_cast<std::uint8_t>(text[start + t]);
  }
  return out;
}

}  // namespace trainer
