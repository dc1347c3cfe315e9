package openai

import (
	"encoding/json"
	"fmt"
	"math/bits"
)

// What multiplies a request's output (docs/limits.md, "Estimator"): the
// engine generates n sequences per prompt (best_of, where an engine still
// honours it, as many as the larger of the two), each up to the output cap,
// and a completions batch ("prompt": [...]) does so for every prompt. The
// admission estimate and the budget reservation count all of them.

// Bounds of what one request may ask Sluice to account for. They keep the
// estimate and the reservation exact in int64 and in Redis's Lua numbers
// (doubles: integers are exact up to 2^53), far beyond any real request
// (128 choices × a 10M-token context is 1.3 × 10^9 tokens).
const (
	// MaxEstimateTokens bounds a request's output cap (n × max_tokens ×
	// prompts) and its admission token estimate: 10^12 tokens.
	MaxEstimateTokens int64 = 1_000_000_000_000
	// MaxReservationMicros bounds a request's maximum cost, the amount it
	// reserves in every budget scope: $10^9 in micro-USD.
	MaxReservationMicros int64 = 1_000_000_000_000_000
)

// sampling is the part of a request that multiplies its output.
type sampling struct {
	// n is the body's n (1 when absent); bestOf its best_of (0 when
	// absent); prompts the number of prompts of a completions batch (1
	// otherwise).
	n, bestOf, prompts int64
	// choices is prompts × max(n, best_of): the sequences the engine may
	// generate, each up to the output cap. 0 (a request built without
	// interpretSampling) counts as 1.
	choices int64
	// choicesParam names the parameter that makes choices > 1.
	choicesParam string
}

// outputChoices returns choices, at least 1.
func (s *sampling) outputChoices() int64 { return max(s.choices, 1) }

// interpretSampling reads n, best_of and the number of prompts, and checks
// that the output cap the request sets fits MaxEstimateTokens.
func (r *Request) interpretSampling() *Error {
	r.n, r.bestOf, r.prompts = 1, 0, 1
	for _, p := range []string{"n", "best_of"} {
		v := r.value(p)
		if isNull(v) {
			continue
		}
		k, ok := plainInt(v)
		if !ok && json.Unmarshal(v, &k) != nil {
			k = 0
		}
		if k < 1 {
			return parseError(CodeInvalidParameter, p, "%s must be a positive integer", p)
		}
		if p == "n" {
			r.n = k
		} else {
			r.bestOf = k
		}
	}
	if v := r.value("prompt"); !isNull(v) {
		r.prompts = countPrompts(v)
	}
	per, perParam := r.n, "n"
	if r.bestOf > per {
		per, perParam = r.bestOf, "best_of"
	}
	switch {
	case per > 1:
		r.choicesParam = perParam
	case r.prompts > 1:
		r.choicesParam = "prompt"
	}
	var ok bool
	if r.choices, ok = mulBounded(r.prompts, per, MaxEstimateTokens); !ok {
		return parseError(CodeEstimateTooLarge, r.choicesParam,
			"%s asks for more than %d generated sequences (%d prompts × %s=%d), more than Sluice accounts for one request",
			r.choicesParam, MaxEstimateTokens, r.prompts, perParam, per)
	}
	if r.maxTokens > MaxEstimateTokens {
		return parseError(CodeInvalidParameter, r.maxTokensParam, "%s must be at most %d", r.maxTokensParam, MaxEstimateTokens)
	}
	if r.maxTokens > 0 {
		if _, ok := mulBounded(r.choices, r.maxTokens, MaxEstimateTokens); !ok {
			return parseError(CodeEstimateTooLarge, r.choicesParam,
				"%d sequences (%s) of up to %s=%d tokens each exceed the %d output tokens Sluice accounts for one request; lower %s or %s",
				r.choices, r.choicesParam, r.maxTokensParam, r.maxTokens, MaxEstimateTokens, r.choicesParam, r.maxTokensParam)
		}
	}
	return nil
}

// countPrompts counts the prompts of a completions "prompt": an array of
// strings or of token-ID arrays is a batch (one prompt each); a string or
// one token-ID array is one prompt. An empty array counts as one (the
// engine refuses it).
func countPrompts(v []byte) int64 {
	if v[0] != '[' {
		return 1
	}
	i := skipWS(v, 1)
	if i >= len(v) || (v[i] != '"' && v[i] != '[') {
		return 1
	}
	var n int64
	for i < len(v) && v[i] != ']' {
		i = skipWS(v, skipValue(v, i))
		n++
		if i < len(v) && v[i] == ',' {
			i = skipWS(v, i+1)
		}
	}
	return max(n, 1)
}

// mulBounded returns a × b for non-negative a and b, and whether it is at
// most limit (false on overflow too).
func mulBounded(a, b, limit int64) (int64, bool) {
	if a < 0 || b < 0 {
		return 0, false
	}
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi != 0 || lo > uint64(limit) {
		return 0, false
	}
	return int64(lo), true
}

// EstimateTooLarge is the answer to a request whose estimate or maximum
// cost exceeds the bounds.
func EstimateTooLarge(param, format string, args ...any) *Error {
	return invalidRequest(CodeEstimateTooLarge, param, fmt.Sprintf(format, args...))
}
