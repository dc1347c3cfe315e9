package anthropic

import (
	"net/http"
	"strings"
	"time"
)

// rateHeaders maps the OpenAI x-ratelimit-* headers Sluice sets to
// Anthropic's names. Anthropic's resets are RFC 3339 times; OpenAI's are
// durations ("1s", "6m0s", "20ms").
var rateHeaders = [...]struct{ from, to string }{
	{"X-Ratelimit-Limit-Requests", "Anthropic-Ratelimit-Requests-Limit"},
	{"X-Ratelimit-Remaining-Requests", "Anthropic-Ratelimit-Requests-Remaining"},
	{"X-Ratelimit-Reset-Requests", "Anthropic-Ratelimit-Requests-Reset"},
	{"X-Ratelimit-Limit-Tokens", "Anthropic-Ratelimit-Tokens-Limit"},
	{"X-Ratelimit-Remaining-Tokens", "Anthropic-Ratelimit-Tokens-Remaining"},
	{"X-Ratelimit-Reset-Tokens", "Anthropic-Ratelimit-Tokens-Reset"},
}

// AddRateHeaders adds the anthropic-ratelimit-* twins of the x-ratelimit-*
// headers set on hd (both names stay: a client reads the ones it knows).
// Resets are now plus the OpenAI duration, in RFC 3339.
func AddRateHeaders(hd http.Header, now time.Time) {
	for _, m := range rateHeaders {
		v := hd.Get(m.from)
		if v == "" {
			continue
		}
		if strings.HasSuffix(m.from, "Reset-Requests") || strings.HasSuffix(m.from, "Reset-Tokens") {
			d, err := time.ParseDuration(v)
			if err != nil {
				continue
			}
			v = now.Add(d).UTC().Format(time.RFC3339)
		}
		hd.Set(m.to, v)
	}
}

// Writer wraps a ResponseWriter of an Anthropic route: when the answer's
// headers are written it adds the anthropic-ratelimit-* headers.
type Writer struct {
	http.ResponseWriter
	wrote bool
}

// WriteHeader adds the Anthropic rate-limit headers, then writes.
func (w *Writer) WriteHeader(status int) {
	if !w.wrote {
		w.wrote = true
		AddRateHeaders(w.Header(), time.Now())
	}
	w.ResponseWriter.WriteHeader(status)
}

// Write writes the headers first if they were not.
func (w *Writer) Write(b []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection (flushes, read
// deadlines).
func (w *Writer) Unwrap() http.ResponseWriter { return w.ResponseWriter }
