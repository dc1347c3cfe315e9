// Package dataplane runs a Sluice data-plane proxy (SPEC §2, §6, §7): it
// keeps its region's configuration current from NATS JetStream, never
// talks to Postgres, and authenticates virtual keys from memory.
//
// Config, New and Run are its exported surface.
package dataplane

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/sluicegw/sluice/dataplane/internal/configsync"
	"github.com/sluicegw/sluice/internal/token"
	"github.com/sluicegw/sluice/proto/wire"
)

// Defaults.
const (
	DefaultAddr         = "127.0.0.1:4000"
	DefaultNATSURL      = "nats://127.0.0.1:4222"
	DefaultRegion       = "default"
	DefaultMaxStaleness = 60 * time.Second
	// StalePolicyReject answers 503 stale_config once the configuration is
	// older than MaxStaleness (the default: fail closed).
	StalePolicyReject = "reject"
	// StalePolicyServe keeps serving the last configuration, reporting the
	// staleness in /readyz and metrics only.
	StalePolicyServe = "serve"
)

// Config configures a data plane. Secrets come from the environment or
// files (see cmd/sluice).
type Config struct {
	// Region whose configuration this instance runs.
	Region string
	// InstanceID names the instance in heartbeats (default: host name,
	// pid and a random suffix).
	InstanceID string
	// NATSURL is the NATS server.
	NATSURL string
	// Addr is the HTTP listen address.
	Addr string
	// MaxStaleness is how long the instance serves without hearing from
	// the control plane before StalePolicy applies.
	MaxStaleness time.Duration
	// StalePolicy is StalePolicyReject or StalePolicyServe.
	StalePolicy string
	// KeyPepper is the versioned HMAC pepper set, as for the control plane.
	KeyPepper string
	// HeartbeatInterval (default 2s).
	HeartbeatInterval time.Duration
	// Logger (nil: discard).
	Logger *slog.Logger
}

// Validate reports every problem at once.
func (c *Config) Validate() error {
	var errs []error
	if !wire.ValidRegion(c.Region) {
		errs = append(errs, fmt.Errorf("region %q: want 1–63 characters of [a-z0-9-]", c.Region))
	}
	if c.NATSURL == "" {
		errs = append(errs, errors.New("NATS URL is required (--nats-url or SLUICE_NATS_URL)"))
	}
	if _, _, err := net.SplitHostPort(c.Addr); err != nil {
		errs = append(errs, fmt.Errorf("listen address %q: %w", c.Addr, err))
	}
	if c.MaxStaleness <= 0 {
		errs = append(errs, errors.New("max staleness must be > 0"))
	}
	if c.StalePolicy != StalePolicyReject && c.StalePolicy != StalePolicyServe {
		errs = append(errs, fmt.Errorf("stale policy %q: want %s or %s", c.StalePolicy, StalePolicyReject, StalePolicyServe))
	}
	if _, err := token.ParsePeppers(c.KeyPepper); err != nil {
		errs = append(errs, fmt.Errorf("key pepper (SLUICE_KEY_PEPPER): %w", err))
	}
	return errors.Join(errs...)
}

// DataPlane is one proxy instance.
type DataPlane struct {
	cfg                                             Config
	log                                             *slog.Logger
	nc                                              *nats.Conn
	sync                                            *configsync.Syncer
	peppers                                         *token.Peppers
	ln                                              net.Listener
	srv                                             *http.Server
	inFlight                                        atomic.Int64
	authOK, authDenied, authRejected, staleRejected atomic.Int64
}

// New validates cfg, connects to NATS (retrying in the background if it
// is down) and binds the listener.
func New(ctx context.Context, cfg Config) (*DataPlane, error) {
	if cfg.MaxStaleness == 0 {
		cfg.MaxStaleness = DefaultMaxStaleness
	}
	if cfg.StalePolicy == "" {
		cfg.StalePolicy = StalePolicyReject
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid configuration:\n%w", err)
	}
	if cfg.InstanceID == "" {
		host, _ := os.Hostname()
		var b [3]byte
		_, _ = rand.Read(b[:])
		cfg.InstanceID = fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b[:]))
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	peppers, _ := token.ParsePeppers(cfg.KeyPepper)
	nc, err := nats.Connect(cfg.NATSURL, nats.Name("sluice-proxy "+cfg.InstanceID), nats.MaxReconnects(-1),
		nats.ReconnectWait(200*time.Millisecond), nats.RetryOnFailedConnect(true), nats.PingInterval(2*time.Second),
		nats.MaxPingsOutstanding(2))
	if err != nil {
		return nil, fmt.Errorf("connect nats: %w", err)
	}
	d := &DataPlane{cfg: cfg, log: log, nc: nc, peppers: peppers}
	d.sync, err = configsync.New(configsync.Config{
		Region: cfg.Region, InstanceID: cfg.InstanceID, MaxStaleness: cfg.MaxStaleness,
		HeartbeatInterval: cfg.HeartbeatInterval, InFlight: d.inFlight.Load, Logger: log,
	}, nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	d.ln, err = net.Listen("tcp", cfg.Addr)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("listen on %s: %w", cfg.Addr, err)
	}
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	d.srv = &http.Server{Handler: d.routes(), Protocols: protocols, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	return d, nil
}

// Addr returns the bound HTTP address.
func (d *DataPlane) Addr() string { return d.ln.Addr().String() }

// Run serves until ctx is done.
func (d *DataPlane) Run(ctx context.Context) error {
	defer d.nc.Close()
	sctx, stopSync := context.WithCancel(ctx)
	syncDone := make(chan struct{})
	go func() { defer close(syncDone); _ = d.sync.Run(sctx) }()
	defer func() { stopSync(); <-syncDone }()
	errc := make(chan error, 1)
	go func() { errc <- d.srv.Serve(d.ln) }()
	d.log.Info("data plane serving", "addr", d.Addr(), "region", d.cfg.Region, "instance", d.cfg.InstanceID)
	select {
	case err := <-errc:
		return fmt.Errorf("http server: %w", err)
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := d.srv.Shutdown(shutdown); err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	return nil
}
