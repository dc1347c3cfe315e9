package vllmsim

import (
	"math/rand/v2"
	"strings"
)

// words is the vocabulary the simulated model writes with. Every word is
// split into pieces exactly as the tokenizer would split it, so generated text
// re-tokenizes to the same token IDs (which is what lets the second turn of a
// conversation hit the prefix cache on the first turn's answer).
var words = strings.Fields(`
the of and to in is that it for was on are as with be at by this have from
or an but not what all were when we there can your which their said if will
each about how up out them then she many some so these would other into has
more her two like him see time could no make than first been its who now
people my made over did down only way find use may water long little very
after word called just where most know get through back much before go good
new write our used me man too any day same right look think also around
another came come work three must because does part even place well such here
take why things help put years different away again off went old number great
tell men say small every found still between name should home big give air
line set own under read last never us left end along while might next sound
below saw something thought both few those always looked show large often
together asked house world going want school important until form food keep
children feet land side without boy once animal life enough took sometimes
four head above kind began almost live page got earth need far hand high year
mother light parts country father let night following picture being study
second eyes soon times story boys since white days ever paper hard near
sentence better best across during today others however sure means knew its
try told young miles sun ways thing whole hear example heard several change
answer room sea against top turned learn point city play toward five using
himself usually model engine token cache request queue batch stream gateway
agent human latency memory block prefix answer system server client metric
`)

// piece is one generated token: its text and ID.
type piece struct {
	text string
	id   TokenID
}

// wordForms holds, for one vocabulary word, the pieces of its four spellings.
type wordForms struct {
	lower, spacedLower, title, spacedTitle []piece
}

var (
	vocabulary  = buildVocabulary()
	periodPiece = piece{text: ".", id: pieceID(".")}
	commaPiece  = piece{text: ",", id: pieceID(",")}
)

func toPieces(s string) []piece {
	var out []piece
	forEachPiece(s, func(p string) { out = append(out, piece{text: p, id: pieceID(p)}) })
	return out
}

func buildVocabulary() []wordForms {
	out := make([]wordForms, len(words))
	for i, w := range words {
		title := strings.ToUpper(w[:1]) + w[1:]
		out[i] = wordForms{
			lower:       toPieces(w),
			spacedLower: toPieces(" " + w),
			title:       toPieces(title),
			spacedTitle: toPieces(" " + title),
		}
	}
	return out
}

// generator produces the deterministic output of one sequence: sentences of
// 6 to 16 words from the vocabulary, with an occasional comma, each ending in
// a period. Token i depends only on the seed.
type generator struct {
	rng          *rand.Rand
	pending      []piece // pieces of the current word; next returns pending[pos]
	pos          int
	started      bool
	wordsLeft    int // words left in the current sentence
	sentenceOpen bool
}

func newGenerator(seed uint64) generator {
	return generator{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// next returns the next token piece.
func (g *generator) next() piece {
	for g.pos == len(g.pending) {
		g.pos = 0
		g.refill()
	}
	p := g.pending[g.pos]
	g.pos++
	return p
}

func (g *generator) refill() {
	if g.sentenceOpen && g.wordsLeft == 0 {
		g.sentenceOpen = false
		g.pending = append(g.pending[:0], periodPiece)
		return
	}
	w := &vocabulary[g.rng.IntN(len(vocabulary))]
	var forms []piece
	switch {
	case !g.started:
		forms = w.title
	case !g.sentenceOpen:
		forms = w.spacedTitle
	default:
		forms = w.spacedLower
	}
	if !g.sentenceOpen {
		g.sentenceOpen = true
		g.wordsLeft = 6 + g.rng.IntN(11)
	}
	g.started = true
	g.wordsLeft--
	g.pending = append(g.pending[:0], forms...)
	if g.wordsLeft > 1 && g.rng.IntN(12) == 0 {
		g.pending = append(g.pending, commaPiece)
	}
}

// FillerText returns deterministic English-looking text of exactly n tokens
// under Tokenize, built from the simulator's vocabulary with the given seed.
// Tests and benchmarks use it to build prompts of known length; different
// seeds give texts that share no prefix beyond chance.
func FillerText(seed uint64, n int) string {
	g := newGenerator(seed)
	var b strings.Builder
	b.Grow(n * 4)
	for i := 0; i < n; i++ {
		b.WriteString(g.next().text)
	}
	return b.String()
}
