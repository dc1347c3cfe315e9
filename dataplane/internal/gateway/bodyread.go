package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// Body reading bounds (docs/proxy.md, "Bodies and timeouts"). A body is
// read only once the key is authenticated, so these bound what an
// authenticated client can hold; requests without a valid key are answered
// from their headers and their bodies are never read.
const (
	// DefaultBodyReadTimeout is how long a request body may take to arrive
	// from the moment the proxy starts reading it (408 after).
	DefaultBodyReadTimeout = 30 * time.Second
	// DefaultMaxBodyReads bounds the bodies being read at once by this
	// instance (503 body_reads_saturated beyond).
	DefaultMaxBodyReads = 256
	// DefaultMaxBodyReadsPerConn bounds the bodies being read at once on
	// one connection (several only over HTTP/2; 429
	// too_many_concurrent_bodies beyond).
	DefaultMaxBodyReadsPerConn = 32
	// initialBodyBuffer is the buffer a body read starts with when the
	// declared length is larger or unknown; it doubles as bytes arrive,
	// never past the declared length (+1 to see the end), so a client
	// declaring 4 MiB and sending one byte costs 16 KiB, not 4 MiB.
	initialBodyBuffer = 16 << 10
)

// connKey carries a connection's connBodies in its requests' contexts.
type connKey struct{}

// connBodies counts the bodies being read on one connection.
type connBodies struct{ reading atomic.Int64 }

// ConnContext is the http.Server ConnContext of a server mounting the
// proxy: it gives each connection the counter MaxBodyReadsPerConn is
// enforced with (without it the per-connection bound does not apply).
func (h *Handler) ConnContext(ctx context.Context, _ net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, new(connBodies))
}

// BodyReads returns the number of request bodies being read now.
func (h *Handler) BodyReads() int64 { return h.bodyReads.Load() }

// acquireBodyRead takes a body-reading slot of the instance and of the
// request's connection, or answers why not.
func (h *Handler) acquireBodyRead(ctx context.Context) (release func(), e *openai.Error) {
	c, _ := ctx.Value(connKey{}).(*connBodies)
	if c != nil && c.reading.Add(1) > int64(h.cfg.MaxBodyReadsPerConn) {
		c.reading.Add(-1)
		return nil, &openai.Error{Status: http.StatusTooManyRequests, Type: openai.TypeRateLimit, Code: openai.CodeTooManyConcurrentBodies, RetryAfter: time.Second,
			Message: fmt.Sprintf("this connection is already sending %d request bodies; send fewer at once or open another connection", h.cfg.MaxBodyReadsPerConn)}
	}
	if h.bodyReads.Add(1) > int64(h.cfg.MaxBodyReads) {
		h.bodyReads.Add(-1)
		if c != nil {
			c.reading.Add(-1)
		}
		return nil, openai.Unavailable(openai.CodeBodyReadsSaturated, "this proxy is reading as many request bodies as it allows at once; retry shortly", time.Second)
	}
	return func() {
		h.bodyReads.Add(-1)
		if c != nil {
			c.reading.Add(-1)
		}
	}, nil
}

// readBody reads the request body within MaxBodyBytes and the body read
// timeout, holding a body-reading slot meanwhile.
func (x *exchange) readBody(w http.ResponseWriter, r *http.Request) ([]byte, *openai.Error) {
	h := x.h
	limit := h.cfg.MaxBodyBytes
	if r.ContentLength > limit {
		h.m.bodyFailures.WithLabelValues(openai.CodeRequestTooLarge).Inc()
		return nil, tooLarge(limit)
	}
	release, e := h.acquireBodyRead(r.Context())
	if e != nil {
		return nil, e
	}
	defer release()
	// The deadline is the connection's (HTTP/1.1) or the stream's (HTTP/2)
	// and is cleared once the body is in: the answer may be a stream of
	// any length, and HTTP/1.1 reads the connection in the background to
	// notice a client that goes away. http.Server.ReadTimeout would cut
	// that background read, hence a deadline per body instead.
	rc := http.NewResponseController(w)
	deadlineSet := rc.SetReadDeadline(time.Now().Add(h.cfg.BodyReadTimeout)) == nil
	body, err := readAll(http.MaxBytesReader(w, r.Body, limit), r.ContentLength)
	if err == nil {
		if deadlineSet {
			_ = rc.SetReadDeadline(time.Time{})
		}
		x.bodyRead = true
		return body, nil
	}
	e = bodyError(r, err, limit, h.cfg.BodyReadTimeout)
	h.m.bodyFailures.WithLabelValues(e.Code).Inc()
	return nil, e
}

// CloseUnreadBody makes an HTTP/1.x answer close its connection when the
// handler did not read the request's body: net/http would otherwise read
// up to 256 KiB of it after the handler, without a deadline, before the
// answer goes out and the connection is reused (a client trickling its
// body would hold the answer and the connection). Over HTTP/2 the stream
// is reset instead and nothing needs doing. Call it before writing.
func CloseUnreadBody(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 1 && r.ContentLength != 0 && r.Body != nil && r.Body != http.NoBody {
		w.Header().Set("Connection", "close")
	}
}

// bodyError maps a failed body read to its answer.
func bodyError(r *http.Request, err error, limit int64, timeout time.Duration) *openai.Error {
	var mbe *http.MaxBytesError
	var ne *net.OpError
	switch {
	case errors.As(err, &mbe):
		return tooLarge(limit)
	case errors.Is(err, os.ErrDeadlineExceeded):
		return &openai.Error{Status: http.StatusRequestTimeout, Type: openai.TypeTimeout, Code: openai.CodeBodyTimeout,
			Message: fmt.Sprintf("the request body did not arrive within %s", timeout)}
	case r.ProtoMajor == 1 && !errors.As(err, &ne), r.ProtoMajor >= 2 && r.Context().Err() == nil:
		// HTTP/1.1: the client closed its side before the declared length
		// (io.ErrUnexpectedEOF) or broke the chunked framing, and may still
		// read the answer. HTTP/2: the stream ended (END_STREAM) short of
		// its content-length; a reset stream cancels the context instead.
		return openai.InvalidRequest(openai.CodeIncompleteBody, "", "the request body ended before its declared length or its framing is broken")
	}
	return &openai.Error{Status: openai.StatusClientClosed, Code: openai.CodeClientClosed, Message: "reading the request body: " + err.Error()}
}

// readAll reads body to its end into a buffer that grows as bytes arrive:
// initialBodyBuffer (or the declared length + 1 when smaller) first, then
// doubling, capped at the declared length + 1 while the body keeps to it.
func readAll(body io.Reader, declared int64) ([]byte, error) {
	size := int64(initialBodyBuffer)
	if declared >= 0 {
		size = min(size, declared+1)
	}
	buf := make([]byte, 0, size)
	for {
		if len(buf) == cap(buf) {
			more := int64(cap(buf))
			if rest := declared + 1 - int64(len(buf)); declared >= 0 && rest > 0 {
				more = min(more, rest)
			}
			grown := make([]byte, len(buf), int64(len(buf))+more) // exact: append would round up
			copy(grown, buf)
			buf = grown
		}
		n, err := body.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		switch {
		case err == io.EOF:
			return buf, nil
		case err != nil:
			return nil, err
		}
	}
}
