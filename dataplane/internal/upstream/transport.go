package upstream

import (
	"net"
	"net/http"
	"time"
)

// DialTimeout bounds connecting to an upstream; a refused or unreachable
// engine fails fast and the request moves on.
const DialTimeout = 5 * time.Second

// NewTransport returns the pooled transport that reaches the engines,
// without compression so that SSE is never buffered by gzip.
func NewTransport() *http.Transport {
	return &http.Transport{
		DialContext:         (&net.Dialer{Timeout: DialTimeout, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        1024,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
}

// NewClient returns the client of rt: it never follows redirects (an
// engine's redirect is its answer).
func NewClient(rt http.RoundTripper) *http.Client {
	return &http.Client{Transport: rt, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}
