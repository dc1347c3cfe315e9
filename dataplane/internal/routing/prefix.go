package routing

import (
	"math"
	"slices"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// Prefix affinity (docs/routing.md, "Prefix affinity"). Requests that
// share a long prompt prefix (the same tools and system prompt, the first
// turns of one conversation) are steered to the same replicas, whose
// prefix cache already holds it.
//
// Extraction: the prefix is the raw JSON of the request's "tools" member
// (when sent) followed by the raw JSON of "messages" (chat) or "prompt"
// (completions), as the client sent them: a client that resends its
// conversation sends the same bytes for the part that did not change, and
// earlier messages come first in the array. The prefix is hashed in
// PrefixBlockSize-byte blocks, each block's hash chained to the previous
// one; the key is the chained hash after PrefixBlocks full blocks. A
// request with fewer bytes has no prefix key (it is not "long"). At most
// PrefixBlocks × PrefixBlockSize bytes of those members are ever read,
// whatever the body's size, and members are located through the parse
// index (no re-scan of the body).
const (
	PrefixBlockSize = 256
	PrefixBlocks    = 8 // the key covers the first 2 KiB (about 500 tokens)
)

// fnv64 is FNV-1a (64 bit): fixed across processes and versions, so every
// proxy of a fleet computes the same keys and scores. maphash's seeds are
// per process and cannot be fixed.
func fnv64(h uint64, b []byte) uint64 {
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h
}

const fnvOffset = 14695981039346656037

// PrefixKey returns the prefix key of req on route and whether it has
// one (see the extraction above).
func PrefixKey(route string, req *openai.Request) (uint64, bool) {
	var parts [2][]byte
	parts[0] = req.Value("tools")
	parts[1] = req.Value(openai.PromptParam(route))
	if isNull(parts[1]) {
		return 0, false
	}
	if isNull(parts[0]) {
		parts[0] = nil
	}
	return prefixKey(parts[:]...)
}

// prefixKey hashes the concatenation of parts in blocks, reading at most
// PrefixBlocks × PrefixBlockSize bytes.
func prefixKey(parts ...[]byte) (uint64, bool) {
	var blk [PrefixBlockSize]byte
	n, blocks := 0, 0
	chain := uint64(fnvOffset)
	for _, p := range parts {
		for len(p) > 0 && blocks < PrefixBlocks {
			c := copy(blk[n:], p)
			n += c
			p = p[c:]
			if n == PrefixBlockSize {
				chain = fnv64(chain, blk[:])
				blocks++
				n = 0
			}
		}
	}
	if blocks < PrefixBlocks {
		return 0, false
	}
	return chain, true
}

// mix is a 64-bit finaliser (splitmix64), spreading rendezvous scores.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// RendezvousScore is the highest-random-weight score of id for key,
// weighted (Schindelhauer–Schomaker logarithmic method: −w / ln(u), u in
// (0,1) from the hash), so a deployment of weight 2 wins twice as many
// keys as one of weight 1 and removing one deployment only moves its own
// keys. Weights below 1 count as 1.
func RendezvousScore(key uint64, id string, weight int64) float64 {
	h := mix(fnv64(key^fnvOffset, []byte(id)))
	u := (float64(h>>11) + 0.5) / (1 << 53) // (0,1)
	return -float64(max(weight, 1)) / math.Log(u)
}

// Loaded is one candidate of a load-aware order.
type Loaded struct {
	ID     string
	Weight int64
	// Load is the candidate's in-flight count (fleet-wide when known).
	Load int64
}

// DefaultLoadFactor is the bound c of bounded-load hashing: a candidate
// whose load is above c × the mean is skipped for the next choice.
const DefaultLoadFactor = 1.25

// BoundedRendezvous returns the order in which to try cands for key:
// by rendezvous score, except that candidates above the load bound —
// load + 1 > c × (total load + 1) / n, the bound of consistent hashing
// with bounded loads (Mirrokni, Thorup, Zadimoghaddam), counting the
// request being placed — go after every candidate within it (in score
// order too), so one hot prefix spills to the next replicas instead of
// melting one engine. overloaded reports whether the first by score was
// skipped. c < 1 counts as DefaultLoadFactor.
func BoundedRendezvous(key uint64, cands []Loaded, c float64) (order []int, overloaded bool) {
	if !(c >= 1) {
		c = DefaultLoadFactor
	}
	n := len(cands)
	order = make([]int, n)
	scores := make([]float64, n)
	var total int64
	for i, x := range cands {
		order[i] = i
		scores[i] = RendezvousScore(key, x.ID, x.Weight)
		total += max(x.Load, 0)
	}
	slices.SortStableFunc(order, func(a, b int) int {
		switch {
		case scores[a] > scores[b]:
			return -1
		case scores[a] < scores[b]:
			return 1
		}
		return 0
	})
	if n < 2 {
		return order, false
	}
	bound := c * float64(total+1) / float64(n)
	within := func(i int) bool { return float64(max(cands[i].Load, 0)+1) <= math.Ceil(bound) }
	first := order[0]
	var in, out []int
	for _, i := range order {
		if within(i) {
			in = append(in, i)
		} else {
			out = append(out, i)
		}
	}
	order = append(in, out...)
	return order, order[0] != first
}

// isNull reports whether a member's raw JSON is absent or null.
func isNull(v []byte) bool { return v == nil || string(v) == "null" }
