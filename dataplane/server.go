package dataplane

import (
	"log/slog"
	"net"
	"net/http"

	"github.com/sluicegw/sluice/dataplane/internal/gateway"
)

// Fixed HTTP server settings.
const (
	// h2ReceiveBufferPerConn and h2ReceiveBufferPerStream are the HTTP/2
	// flow-control windows the proxy grants (net/http's defaults, stated
	// here because they bound what one connection can make it buffer:
	// at most h2ReceiveBufferPerConn of request bodies not yet read,
	// whatever its number of streams).
	h2ReceiveBufferPerConn   = 1 << 20
	h2ReceiveBufferPerStream = 1 << 20
	// maxHeaderBytes bounds a request's headers (net/http's default).
	maxHeaderBytes = http.DefaultMaxHeaderBytes
)

// newServer returns the HTTP server of the data plane (HTTP/1.1 and h2c on
// one listener).
func (d *DataPlane) newServer(h http.Handler) *http.Server {
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	return &http.Server{Handler: h, Protocols: protocols,
		ReadHeaderTimeout: d.cfg.ReadHeaderTimeout, IdleTimeout: d.cfg.IdleTimeout, MaxHeaderBytes: maxHeaderBytes,
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: d.cfg.H2MaxConcurrentStreams,
			MaxReceiveBufferPerConnection: h2ReceiveBufferPerConn, MaxReceiveBufferPerStream: h2ReceiveBufferPerStream},
		ConnContext: d.proxy.ConnContext,
		ConnState:   d.trackConn,
		ErrorLog:    slog.NewLogLogger(d.log.Handler(), slog.LevelWarn)}
}

// trackConn counts the open client connections
// (sluice_dataplane_open_connections).
func (d *DataPlane) trackConn(_ net.Conn, s http.ConnState) {
	switch s {
	case http.StateNew:
		d.openConns.Add(1)
	case http.StateClosed, http.StateHijacked:
		d.openConns.Add(-1)
	}
}

// headersOnly wraps a handler that never reads a request body (see
// gateway.CloseUnreadBody).
func headersOnly(f http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		gateway.CloseUnreadBody(w, r)
		f(w, r)
	}
}
