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
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/configsync"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	apiproxy "github.com/sluicegw/sluice/dataplane/internal/proxy"
	"github.com/sluicegw/sluice/dataplane/internal/usage"
	"github.com/sluicegw/sluice/internal/keyring"
	"github.com/sluicegw/sluice/internal/token"
	"github.com/sluicegw/sluice/proto/wire"
)

// Defaults.
const (
	DefaultAddr         = "127.0.0.1:4000"
	DefaultNATSURL      = "nats://127.0.0.1:4222"
	DefaultRegion       = "default"
	DefaultMaxStaleness = 60 * time.Second
	// DefaultMaxBodyBytes bounds OpenAI request bodies (413 above).
	DefaultMaxBodyBytes = apiproxy.DefaultMaxBodyBytes
	// DefaultRequestTimeout is the total deadline of one OpenAI request.
	DefaultRequestTimeout = apiproxy.DefaultRequestTimeout
	// DefaultMaxRetries is how many other deployments a request may try.
	DefaultMaxRetries = apiproxy.DefaultMaxRetries
	// DefaultUsageBufferSize is the in-memory usage-event buffer (events).
	DefaultUsageBufferSize = usage.DefaultBufferSize
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
	// KEK is the control plane's key ring (SLUICE_KEK), used to open the
	// upstream credentials of deployments. Optional: without it (or with
	// a ring lacking a credential's key version) a deployment that has a
	// credential is unavailable, and each failure is logged as an error.
	KEK string
	// HeartbeatInterval (default 2s).
	HeartbeatInterval time.Duration
	// UsageBufferSize is the in-memory usage-event buffer in events
	// (default usage.DefaultBufferSize); beyond it events are spooled.
	UsageBufferSize int
	// UsageSpoolDir is where usage events go when the buffer is full or at
	// shutdown (default: a new temporary directory per instance). Give
	// each instance its own persistent directory so a restarted instance
	// replays what its predecessor spooled.
	UsageSpoolDir string
	// MaxBodyBytes bounds OpenAI request bodies (413 above it; default
	// apiproxy.DefaultMaxBodyBytes, 4 MiB).
	MaxBodyBytes int64
	// RequestTimeout is the total deadline of one OpenAI request across
	// all its upstream attempts, streams included (default
	// apiproxy.DefaultRequestTimeout, 10 min).
	RequestTimeout time.Duration
	// MaxRetries is how many other deployments a request may try after a
	// retryable upstream failure before its first byte (default
	// apiproxy.DefaultMaxRetries, 2; negative: none).
	MaxRetries int
	// RedisURL is the limits store (redis://host:port/db; default
	// DefaultRedisURL). RedisClusterAddrs, when set, selects a Redis
	// Cluster instead.
	RedisURL          string
	RedisClusterAddrs []string
	// RedisKeyPrefix is prepended to every limits key (default
	// DefaultRedisKeyPrefix); data planes sharing limits share it.
	RedisKeyPrefix string
	// LimitsCallTimeout bounds every limits-store call (default
	// limits.DefaultCallTimeout, 50 ms); slower is unavailable.
	LimitsCallTimeout time.Duration
	// LeaseTTL is the life of a concurrency slot without renewal: how long
	// a killed proxy's slots take to come back (default 30 s).
	LeaseTTL time.Duration
	// RateLimitFallback is RateFallbackClosed (default) or
	// RateFallbackLocal: what rpm/tpm-only requests get while Redis is
	// unavailable. Budgets and concurrency always fail closed.
	RateLimitFallback string
	// DefaultMaxOutputTokens bounds the output of requests without
	// max_tokens on deployments without max_output_tokens, for token
	// estimates and budget reservations (default 4096).
	DefaultMaxOutputTokens int64
	// SoleDataPlane declares that this instance is the only data plane
	// using its Redis key prefix, as under `sluice dev`: once its first
	// snapshot is loaded it bootstraps the limits epoch of every org and
	// deployment, so nothing waits out the quarantine that follows a Redis
	// without state. With several data planes this would hide a Redis
	// state loss from the others; leave it off.
	SoleDataPlane bool
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
	if c.MaxBodyBytes < 0 {
		errs = append(errs, fmt.Errorf("max body bytes %d: must not be negative", c.MaxBodyBytes))
	}
	if c.RequestTimeout < 0 {
		errs = append(errs, fmt.Errorf("request timeout %s: must not be negative", c.RequestTimeout))
	}
	if c.UsageBufferSize < 0 {
		errs = append(errs, fmt.Errorf("usage buffer size %d: must not be negative", c.UsageBufferSize))
	}
	if strings.TrimSpace(c.KEK) != "" {
		if _, err := keyring.Parse(c.KEK); err != nil {
			errs = append(errs, fmt.Errorf("key ring (SLUICE_KEK): %w", err))
		}
	}
	errs = append(errs, validateLimits(c)...)
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
	// usage publishes one usage event per request (the proxy's UsageSink).
	usage *usage.Publisher
	// registry holds every metric /metrics exposes.
	registry *prometheus.Registry
	// proxy serves the OpenAI endpoints.
	proxy *apiproxy.Handler
	// rdb is the limits store; alerts publishes budget alerts; fleet
	// counts the region's live data planes (local rpm/tpm fallback).
	rdb       io.Closer
	alerts    *alertPublisher
	fleetSub  *nats.Subscription
	bootstrap func(orgs, deployments []string)
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
	if cfg.RedisURL == "" && len(cfg.RedisClusterAddrs) == 0 {
		cfg.RedisURL = DefaultRedisURL
	}
	if cfg.RedisKeyPrefix == "" {
		cfg.RedisKeyPrefix = DefaultRedisKeyPrefix
	}
	if cfg.RateLimitFallback == "" {
		cfg.RateLimitFallback = RateFallbackClosed
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

	d.usage, err = usage.New(usage.Config{Region: cfg.Region, BufferSize: cfg.UsageBufferSize,
		SpoolDir: cfg.UsageSpoolDir, Logger: log}, nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	lim, rdb, err := limitsSetup(&cfg)
	if err != nil {
		nc.Close()
		return nil, err
	}
	d.rdb = rdb
	d.bootstrap = bootstrapEpochs(lim, log)
	var beforeFirst func(*catalog.Catalog)
	if cfg.SoleDataPlane {
		beforeFirst = d.bootstrapAll
	}
	d.sync, err = configsync.New(configsync.Config{
		Region: cfg.Region, InstanceID: cfg.InstanceID, MaxStaleness: cfg.MaxStaleness,
		HeartbeatInterval: cfg.HeartbeatInterval, InFlight: d.inFlight.Load, Logger: log, Open: credentialOpener(cfg.KEK, log),
		OnCreate: d.bootstrap, BeforeFirst: beforeFirst,
	}, nc)
	if err != nil {
		d.closeClients()
		return nil, err
	}
	d.registry = prometheus.NewRegistry()
	d.registerMetrics()
	if d.alerts, err = newAlertPublisher(nc, cfg.Region, log); err != nil {
		d.closeClients()
		return nil, err
	}
	// The local rpm/tpm fallback is always ready: levels may ask for it
	// (rate_limit_fallback "local") even when the default is closed.
	hb := cfg.HeartbeatInterval
	if hb == 0 {
		hb = configsync.DefaultHeartbeatInterval
	}
	fv, sub, err := newFleetView(nc, cfg.Region, cfg.InstanceID, hb)
	if err != nil {
		d.closeClients()
		return nil, fmt.Errorf("subscribe to heartbeats: %w", err)
	}
	d.fleetSub = sub
	fallback := limits.NewLocalLimiter(fv.Live)
	d.proxy, err = apiproxy.New(apiproxy.Config{Catalog: d.sync.Catalog, Gate: d.gate, Peppers: peppers, Usage: d.usage,
		Registerer: d.registry, Region: cfg.Region, InstanceID: cfg.InstanceID, MaxBodyBytes: cfg.MaxBodyBytes,
		RequestTimeout: cfg.RequestTimeout, MaxRetries: cfg.MaxRetries, Logger: log,
		Limiter: lim, RateFallback: fallback, RateFallbackDefault: cfg.RateLimitFallback == RateFallbackLocal, Alerts: d.alerts, DefaultMaxOutputTokens: cfg.DefaultMaxOutputTokens})
	if err != nil {
		d.closeClients()
		return nil, err
	}
	d.ln, err = net.Listen("tcp", cfg.Addr)
	if err != nil {
		d.closeClients()
		return nil, fmt.Errorf("listen on %s: %w", cfg.Addr, err)
	}
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	d.srv = &http.Server{Handler: d.routes(), Protocols: protocols, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	return d, nil
}

// errNoKeyRing is the credential error of every deployment with a
// credential on a data plane started without SLUICE_KEK.
var errNoKeyRing = errors.New("no key ring configured (SLUICE_KEK) to decrypt the credential")

// credentialOpener returns the function the catalog decrypts deployment
// credentials with. Every failure is logged as an error (never the
// ciphertext or the plaintext): the catalog marks the deployment
// unavailable (CredentialErr), and an operator must hear about it.
func credentialOpener(kek string, log *slog.Logger) catalog.OpenFunc {
	var ring *keyring.Ring
	if strings.TrimSpace(kek) != "" {
		ring, _ = keyring.Parse(kek) // validated by Config.Validate
	}
	return func(ct []byte) ([]byte, error) {
		if ring == nil {
			log.Error("deployment credential cannot be decrypted: no key ring configured (SLUICE_KEK); the deployment is unavailable",
				"key_version", keyVersion(ct))
			return nil, errNoKeyRing
		}
		pt, err := ring.Open(ct)
		if err != nil {
			log.Error("deployment credential cannot be decrypted; the deployment is unavailable",
				"key_version", keyVersion(ct), "current_key_version", ring.Current(), "error", err)
			return nil, err
		}
		return pt, nil
	}
}

// keyVersion returns the key version a ciphertext names ("v2"), or "".
func keyVersion(ct []byte) string {
	v, _, ok := strings.Cut(string(ct[:min(len(ct), 12)]), ":")
	if !ok || !strings.HasPrefix(v, "v") {
		return ""
	}
	return v
}

// Addr returns the bound HTTP address.
func (d *DataPlane) Addr() string { return d.ln.Addr().String() }

// bootstrapAll bootstraps the limits epochs of every org and deployment of
// the first catalog, before it serves (Config.SoleDataPlane).
func (d *DataPlane) bootstrapAll(cat *catalog.Catalog) {
	var deps []string
	for _, dep := range cat.AllDeployments() {
		deps = append(deps, dep.GetId())
	}
	orgs := cat.OrgIDs()
	d.bootstrap(orgs, deps)
	d.log.Info("limits epochs bootstrapped (sole data plane)", "orgs", len(orgs), "deployments", len(deps))
}

func (d *DataPlane) closeClients() {
	if d.rdb != nil {
		_ = d.rdb.Close()
	}
	d.nc.Close()
}

// Run serves until ctx is done.
func (d *DataPlane) Run(ctx context.Context) error {
	defer d.closeClients()
	// Budget alerts are published until the end, after the last settlement.
	actx, stopAlerts := context.WithCancel(context.WithoutCancel(ctx))
	alertsDone := make(chan struct{})
	go func() { defer close(alertsDone); d.alerts.run(actx) }()
	defer func() { stopAlerts(); <-alertsDone }()
	sctx, stopSync := context.WithCancel(ctx)
	syncDone := make(chan struct{})
	go func() { defer close(syncDone); _ = d.sync.Run(sctx) }()
	defer func() { stopSync(); <-syncDone }()
	// The usage publisher outlives the HTTP server: it stops (flushing,
	// then spooling the rest) only after Shutdown has waited for the
	// in-flight requests, whose usage events it must still take.
	uctx, stopUsage := context.WithCancel(context.WithoutCancel(ctx))
	usageDone := make(chan struct{})
	go func() { defer close(usageDone); _ = d.usage.Run(uctx) }()
	defer func() { stopUsage(); <-usageDone }()
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
	err := d.srv.Shutdown(shutdown)
	// Settlements of the last requests (leases, tpm, budgets) before the
	// Redis client closes.
	if derr := d.proxy.Drain(shutdown); derr != nil {
		d.log.Error("limits settlements still pending at shutdown; their leases expire by TTL", "error", derr)
	}
	if err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	return nil
}
