package dataplane

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/admission"
	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/dataplane/internal/configsync"
	"github.com/sluicegw/sluice/dataplane/internal/gateway"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	"github.com/sluicegw/sluice/dataplane/internal/upstream"
	"github.com/sluicegw/sluice/dataplane/internal/usage"
	"github.com/sluicegw/sluice/internal/keyring"
	"github.com/sluicegw/sluice/internal/token"
	"github.com/sluicegw/sluice/proto/wire"
)

// config.go is the data plane's configuration: Config, its defaults as
// named constants, setDefaults (the one layer of defaults, applied by New)
// and Validate (every problem at once).

// Defaults.
const (
	DefaultAddr         = "127.0.0.1:4000"
	DefaultNATSURL      = "nats://127.0.0.1:4222"
	DefaultRegion       = "default"
	DefaultMaxStaleness = 60 * time.Second
	// DefaultJWKSMaxStale and DefaultJWKSRefreshInterval: JWT issuers'
	// signing keys (docs/jwt.md).
	DefaultJWKSMaxStale        = authn.DefaultJWKSMaxStale
	DefaultJWKSRefreshInterval = authn.DefaultJWKSRefreshInterval
	// DefaultMaxRejecting bounds how long an instance may refuse its
	// region's current snapshot before /readyz fails.
	DefaultMaxRejecting = configsync.DefaultMaxRejecting
	// DefaultMaxBodyBytes bounds OpenAI request bodies (413 above).
	DefaultMaxBodyBytes = gateway.DefaultMaxBodyBytes
	// DefaultGCHeapFloor is `sluice proxy`'s heap floor (internal/gctune):
	// while the live heap is small, the garbage collector lets the heap
	// grow to about this many bytes before it collects.
	DefaultGCHeapFloor = 64 << 20
	// DefaultRequestTimeout is the total deadline of one OpenAI request.
	DefaultRequestTimeout = gateway.DefaultRequestTimeout
	// DefaultMaxRetries is how many other deployments a request may try.
	DefaultMaxRetries = gateway.DefaultMaxRetries
	// DefaultAdmissionQueues are the per-class admission queue bounds.
	DefaultAdmissionQueues = "interactive=256/30s,agent=1024/1m0s,batch=1024/2m0s"
	// DefaultAdmissionRetryInterval: a queued request tries at least this often.
	DefaultAdmissionRetryInterval = gateway.DefaultAdmissionRetryInterval
	// DefaultTTFTTimeout is the TTFT deadline of a stream attempt.
	DefaultTTFTTimeout = gateway.DefaultTTFTTimeout
	// DefaultRetryBudgetRatio and DefaultRetryBudgetMin are the retry
	// budget of every model group (docs/resilience.md).
	DefaultRetryBudgetRatio = upstream.DefaultRetryBudgetRatio
	DefaultRetryBudgetMin   = upstream.DefaultRetryBudgetMin
	// DefaultMaxEjectionPercent and DefaultParkMax bound passive health.
	DefaultMaxEjectionPercent = upstream.DefaultMaxEjectionPercent
	DefaultParkMax            = upstream.ParkMax
	// DefaultEjectionBase and DefaultEjectionMax are the passive ejection
	// backoff: the first ejection, doubling up to the max.
	DefaultEjectionBase = upstream.EjectBase
	DefaultEjectionMax  = upstream.EjectMax
	// Active health check defaults.
	DefaultHealthCheckInterval  = upstream.DefaultHealthCheckInterval
	DefaultHealthCheckTimeout   = upstream.DefaultHealthCheckTimeout
	DefaultHealthCheckUnhealthy = upstream.DefaultUnhealthyThreshold
	DefaultHealthCheckHealthy   = upstream.DefaultHealthyThreshold
	// DefaultEngineMetricsInterval and DefaultEngineMetricsMaxAge: the
	// engine_load strategy's polls of the engines' /metrics.
	DefaultEngineMetricsInterval = upstream.DefaultEngineMetricsInterval
	DefaultEngineMetricsMaxAge   = upstream.DefaultEngineMetricsMaxAge
	// DefaultUsageBufferSize is the in-memory usage-event buffer (events).
	DefaultUsageBufferSize = usage.DefaultBufferSize
	// DefaultUsageBatchEvents is the most usage events one JetStream
	// message carries (docs/ledger.md, "Batches").
	DefaultUsageBatchEvents = usage.DefaultBatchEvents
	// maxUsageBatchEvents bounds UsageBatchEvents: a batch stays far below
	// the ledger's transaction size and NATS's max payload.
	maxUsageBatchEvents = 1000
	// StalePolicyReject answers 503 stale_config once the configuration is
	// older than MaxStaleness (the default: fail closed).
	StalePolicyReject = "reject"
	// StalePolicyServe keeps serving the last configuration, reporting the
	// staleness in /readyz and metrics only.
	StalePolicyServe = "serve"
)

// Limits defaults (docs/limits.md).
const (
	DefaultRedisURL       = "redis://127.0.0.1:6379/0"
	DefaultRedisKeyPrefix = "sluice:"
	// RateFallbackClosed refuses rpm/tpm-limited requests while Redis is
	// unavailable (503 limits_unavailable), like budgets and concurrency.
	RateFallbackClosed = "closed"
	// RateFallbackLocal admits rpm/tpm-only requests by this instance's
	// share of each limit (limit ÷ live data planes in the region).
	RateFallbackLocal = "local"
	// DefaultLimitsCallTimeout bounds every limits-store call.
	DefaultLimitsCallTimeout = limits.DefaultCallTimeout
	// DefaultLeaseTTL is the life of a concurrency slot without renewal.
	DefaultLeaseTTL = limits.DefaultLeaseTTL
	// DefaultMaxOutputTokens bounds estimates of requests without max_tokens.
	DefaultMaxOutputTokens = gateway.DefaultMaxOutputTokens
)

// HTTP server bounds (docs/proxy.md, "Bodies and timeouts").
//
// There is no http.Server ReadTimeout or WriteTimeout: answers are streams
// of any length (bounded by RequestTimeout), and an HTTP/1.1 ReadTimeout
// would also cut the background read with which net/http notices that a
// client went away mid-stream. Instead headers have ReadHeaderTimeout,
// bodies a deadline of their own (BodyReadTimeout, set per request and
// cleared once the body is in), and idle connections IdleTimeout.
const (
	// DefaultReadHeaderTimeout bounds reading a request's headers (and,
	// on a new connection, waiting for its first request).
	DefaultReadHeaderTimeout = 10 * time.Second
	// DefaultIdleTimeout closes a keep-alive connection (HTTP/1.1 or
	// h2c) without a request in flight for this long. Above the 60 s idle
	// timeout of common load balancers, so that the proxy is not the side
	// closing a connection the balancer is about to reuse.
	DefaultIdleTimeout = 120 * time.Second
	// DefaultBodyReadTimeout bounds the time a request body takes to
	// arrive once the proxy starts reading it (408 after).
	DefaultBodyReadTimeout = gateway.DefaultBodyReadTimeout
	// DefaultMaxBodyReads bounds the request bodies being read at once.
	DefaultMaxBodyReads = gateway.DefaultMaxBodyReads
	// DefaultMaxBodyReadsPerConn bounds those of one connection.
	DefaultMaxBodyReadsPerConn = gateway.DefaultMaxBodyReadsPerConn
	// DefaultH2MaxConcurrentStreams bounds the streams an h2c client may
	// have open on one connection (more are refused with REFUSED_STREAM).
	DefaultH2MaxConcurrentStreams = 100
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
	// JWKSMaxStale is how long the last good signing keys of a trusted
	// JWT issuer are used while its JWKS cannot be fetched (0:
	// authn.DefaultJWKSMaxStale, 5 min; it must exceed
	// JWKSRefreshInterval). JWKSRefreshInterval is how often the keys of
	// the issuers in use are fetched again (0:
	// authn.DefaultJWKSRefreshInterval, 1 min). docs/jwt.md.
	JWKSMaxStale, JWKSRefreshInterval time.Duration
	// MaxRejecting is how long the instance may refuse the snapshot its
	// region's pointer names (running an older one) before its health is
	// "rejecting" and /readyz fails (default
	// DefaultMaxRejecting, 30 s). It keeps serving its last
	// good snapshot either way.
	MaxRejecting time.Duration
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
	// UsageBatchEvents is the most usage events one JetStream message
	// carries (default DefaultUsageBatchEvents). 1 publishes each event as
	// its own message, the only format control planes before batches
	// read: for a rolling upgrade that reaches data planes first.
	UsageBatchEvents int
	// UsageSpoolDir is where usage events go when the buffer is full or at
	// shutdown (default: a new temporary directory per instance). Give
	// each instance its own persistent directory so a restarted instance
	// replays what its predecessor spooled.
	UsageSpoolDir string
	// MaxBodyBytes bounds OpenAI request bodies (413 above it; default
	// gateway.DefaultMaxBodyBytes, 4 MiB).
	MaxBodyBytes int64
	// RequestTimeout is the total deadline of one OpenAI request across
	// all its upstream attempts, streams included (default
	// gateway.DefaultRequestTimeout, 10 min).
	RequestTimeout time.Duration
	// MaxRetries is how many other deployments a request may try after a
	// retryable upstream failure before its first byte (default
	// gateway.DefaultMaxRetries, 2; NoRetries turns them off).
	MaxRetries int
	// NoRetries turns retries off: every request makes one attempt. It is
	// the explicit "off" of MaxRetries (whose zero means the default).
	NoRetries bool
	// AdmissionQueues are the per-class admission queue bounds,
	// "class=length/timeout,..." (admission.ParseBounds; "": the
	// defaults, DefaultAdmissionQueues). AdmissionRetryInterval is how
	// often a queued request tries for a slot at least (0: the default).
	AdmissionQueues        string
	AdmissionRetryInterval time.Duration
	// TTFTTimeout abandons a stream attempt that relayed nothing for this
	// long (retried elsewhere when the attempt budget allows; default
	// DefaultTTFTTimeout, 30 s); NoTTFTTimeout turns it off.
	TTFTTimeout   time.Duration
	NoTTFTTimeout bool
	// RetryBudgetRatio bounds a model group's retries to this fraction of
	// its requests over a sliding 10 s window (default 0.2, within (0, 1]);
	// RetryBudgetMin retries per window are always allowed (default 10).
	RetryBudgetRatio float64
	RetryBudgetMin   int
	// MaxEjectionPercent bounds the share of a pool that ejections and
	// Retry-After parkings take out at once (default 50, within 1–100).
	MaxEjectionPercent int
	// ParkMax caps a deployment's Retry-After parking (default 60 s).
	ParkMax time.Duration
	// EjectionBase and EjectionMax are the passive ejection backoff
	// (default 1 s doubling up to 30 s); PanicThresholdPercent routes to a
	// whole pool when more than that share is out (default 0: off). A
	// model group's resilience settings override them.
	EjectionBase, EjectionMax time.Duration
	PanicThresholdPercent     int
	// NoStreamProbation turns the stream probation off (--stream-probation
	// =false; on by default): streams to a deployment this instance has
	// not yet seen stream cleanly (or that cut a stream or was ejected
	// since) are held back from their client until the first clean one,
	// at most 2 s, so that a cut within the hold is retried elsewhere
	// (docs/resilience.md, "Stream probation").
	NoStreamProbation bool
	// Active health checks of every engine's /health: interval (default
	// 5 s), per-probe timeout (1 s), failures in a row that take a
	// deployment out (2) and successes that bring it back (1);
	// NoHealthChecks turns them off.
	HealthCheckInterval, HealthCheckTimeout  time.Duration
	HealthCheckUnhealthy, HealthCheckHealthy int
	NoHealthChecks                           bool
	// Engine metrics of the engine_load strategy: each engine's /metrics
	// polled every EngineMetricsInterval (default 1 s), a sample ignored
	// once older than EngineMetricsMaxAge (default 5 s; the strategy then
	// counts the fleet-wide in-flight requests alone); NoEngineMetrics
	// turns the polls off.
	EngineMetricsInterval, EngineMetricsMaxAge time.Duration
	NoEngineMetrics                            bool
	// ReadHeaderTimeout bounds reading a request's headers (default
	// DefaultReadHeaderTimeout, 10 s); IdleTimeout closes connections
	// without a request in flight (default DefaultIdleTimeout, 120 s);
	// BodyReadTimeout bounds the arrival of a request body (default
	// DefaultBodyReadTimeout, 30 s). See server.go for why there is no
	// ReadTimeout or WriteTimeout.
	ReadHeaderTimeout, IdleTimeout, BodyReadTimeout time.Duration
	// MaxBodyReads bounds the request bodies read at once by the instance
	// (default DefaultMaxBodyReads, 256; 503 body_reads_saturated beyond),
	// MaxBodyReadsPerConn those of one connection (default
	// DefaultMaxBodyReadsPerConn, 32; 429 too_many_concurrent_bodies).
	MaxBodyReads, MaxBodyReadsPerConn int
	// H2MaxConcurrentStreams bounds the streams of one h2c connection
	// (default DefaultH2MaxConcurrentStreams, 100).
	H2MaxConcurrentStreams int
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
	// a killed proxy's slots take to come back (default 30 s). Its requests'
	// reservations are settled by a sweeper (every data plane runs one,
	// every LeaseTTL/4) within LeaseTTL plus one sweep interval.
	LeaseTTL time.Duration
	// RateLimitFallback is RateFallbackClosed (default) or
	// RateFallbackLocal: what rpm/tpm-only requests get while Redis is
	// unavailable. Budgets and concurrency always fail closed.
	RateLimitFallback string
	// NoLimitSlices turns quota slices off (docs/limits.md, "Quota
	// slices"): every limited request is then admitted exactly, with one
	// Redis call. By default (false) hot scopes with large rpm/tpm,
	// concurrency and budget limits are admitted from slices of the
	// fleet-wide limits held by this data plane, without a Redis round
	// trip, and smaller limits or scopes near their limit exactly.
	NoLimitSlices bool
	// IETFRateLimitHeaders adds the IETF RateLimit and RateLimit-Policy
	// fields (draft-ietf-httpapi-ratelimit-headers) to the x-ratelimit-*
	// headers of answers to requests with rpm/tpm limits (default off:
	// docs/limits.md, "Headers").
	IETFRateLimitHeaders bool
	// ProfileLabels labels request goroutines in CPU profiles with their
	// org and key (gateway.Config.ProfileLabels; `sluice proxy
	// --pprof-labels`).
	ProfileLabels bool
	// DefaultMaxOutputTokens bounds the output of requests without
	// max_tokens on deployments without max_output_tokens, for token
	// estimates and budget reservations (default 4096).
	DefaultMaxOutputTokens int64
	// BudgetSeedWait bounds how long a request waits while the budget
	// windows Redis does not hold (first use, or Redis lost its state) are
	// seeded from the control plane's ledger; past it the answer is 503
	// limits_recovering (default DefaultBudgetSeedWait, 2 s).
	BudgetSeedWait time.Duration
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
	if c.MaxRejecting < 0 {
		errs = append(errs, fmt.Errorf("max rejecting %s: must not be negative", c.MaxRejecting))
	}
	if c.JWKSMaxStale < 0 || c.JWKSRefreshInterval < 0 {
		errs = append(errs, errors.New("jwks max stale and refresh interval must not be negative"))
	} else if stale, every := orDefault(c.JWKSMaxStale, authn.DefaultJWKSMaxStale), orDefault(c.JWKSRefreshInterval, authn.DefaultJWKSRefreshInterval); stale <= every {
		errs = append(errs, fmt.Errorf("jwks max stale %s must exceed the jwks refresh interval %s", stale, every))
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
	if _, err := admission.ParseBounds(c.AdmissionQueues); err != nil {
		errs = append(errs, err)
	}
	if c.AdmissionRetryInterval < 0 {
		errs = append(errs, fmt.Errorf("admission retry interval %s: must not be negative", c.AdmissionRetryInterval))
	}
	if c.MaxRetries < 0 {
		errs = append(errs, fmt.Errorf("max retries %d: must not be negative (retries are turned off with NoRetries, --max-retries=0)", c.MaxRetries))
	}
	if c.NoRetries && c.MaxRetries > 0 {
		errs = append(errs, fmt.Errorf("max retries %d with retries turned off: set one or the other", c.MaxRetries))
	}
	if c.RequestTimeout < 0 {
		errs = append(errs, fmt.Errorf("request timeout %s: must not be negative", c.RequestTimeout))
	}
	if c.TTFTTimeout < 0 {
		errs = append(errs, fmt.Errorf("ttft timeout %s: must not be negative (NoTTFTTimeout, --ttft-timeout=0, turns it off)", c.TTFTTimeout))
	}
	if c.NoTTFTTimeout && c.TTFTTimeout > 0 {
		errs = append(errs, fmt.Errorf("ttft timeout %s with the TTFT deadline turned off: set one or the other", c.TTFTTimeout))
	}
	if c.RetryBudgetRatio < 0 || c.RetryBudgetRatio > 1 {
		errs = append(errs, fmt.Errorf("retry budget %g: must be within (0, 1] (retries are turned off with --max-retries=0)", c.RetryBudgetRatio))
	}
	if c.MaxEjectionPercent < 0 || c.MaxEjectionPercent > 100 {
		errs = append(errs, fmt.Errorf("max ejection percent %d: must be within 1–100", c.MaxEjectionPercent))
	}
	if c.EngineMetricsInterval < 0 || c.EngineMetricsMaxAge < 0 {
		errs = append(errs, fmt.Errorf("engine metrics interval %s, max age %s: must not be negative", c.EngineMetricsInterval, c.EngineMetricsMaxAge))
	}
	if c.HealthCheckInterval < 0 || c.HealthCheckTimeout < 0 || c.HealthCheckUnhealthy < 0 || c.HealthCheckHealthy < 0 {
		errs = append(errs, fmt.Errorf("health check interval %s, timeout %s, thresholds %d/%d: must not be negative",
			c.HealthCheckInterval, c.HealthCheckTimeout, c.HealthCheckUnhealthy, c.HealthCheckHealthy))
	}
	if c.ParkMax < 0 {
		errs = append(errs, fmt.Errorf("park max %s: must not be negative", c.ParkMax))
	}
	if c.EjectionBase < 0 || c.EjectionMax < 0 || (c.EjectionBase > 0 && c.EjectionMax > 0 && c.EjectionBase > c.EjectionMax) {
		errs = append(errs, fmt.Errorf("ejection base %s, max %s: must not be negative, base not above max", c.EjectionBase, c.EjectionMax))
	}
	if c.PanicThresholdPercent < 0 || c.PanicThresholdPercent > 100 {
		errs = append(errs, fmt.Errorf("panic threshold %d: must be within 0–100", c.PanicThresholdPercent))
	}
	if c.RetryBudgetMin < 0 {
		errs = append(errs, fmt.Errorf("retry budget minimum %d: must not be negative", c.RetryBudgetMin))
	}
	if c.UsageBufferSize < 0 {
		errs = append(errs, fmt.Errorf("usage buffer size %d: must not be negative", c.UsageBufferSize))
	}
	if c.UsageBatchEvents < 0 || c.UsageBatchEvents > maxUsageBatchEvents {
		errs = append(errs, fmt.Errorf("usage batch events %d: must be between 1 and %d (0: the default, %d)",
			c.UsageBatchEvents, maxUsageBatchEvents, DefaultUsageBatchEvents))
	}
	if strings.TrimSpace(c.KEK) != "" {
		if _, err := keyring.Parse(c.KEK); err != nil {
			errs = append(errs, fmt.Errorf("key ring (SLUICE_KEK): %w", err))
		}
	}
	errs = append(errs, validateLimits(c)...)
	errs = append(errs, validateServer(c)...)
	return errors.Join(errs...)
}

// setDefaults fills the zero settings of c with their defaults.
func (c *Config) setDefaults() {
	if c.MaxStaleness == 0 {
		c.MaxStaleness = DefaultMaxStaleness
	}
	if c.StalePolicy == "" {
		c.StalePolicy = StalePolicyReject
	}
	if c.RedisURL == "" && len(c.RedisClusterAddrs) == 0 {
		c.RedisURL = DefaultRedisURL
	}
	if c.RedisKeyPrefix == "" {
		c.RedisKeyPrefix = DefaultRedisKeyPrefix
	}
	if c.RateLimitFallback == "" {
		c.RateLimitFallback = RateFallbackClosed
	}
	serverDefaults(c)
}

// serverDefaults fills the zero server settings of c with their defaults.
func serverDefaults(c *Config) {
	if c.ReadHeaderTimeout == 0 {
		c.ReadHeaderTimeout = DefaultReadHeaderTimeout
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = DefaultIdleTimeout
	}
	if c.BodyReadTimeout == 0 {
		c.BodyReadTimeout = DefaultBodyReadTimeout
	}
	if c.MaxBodyReads == 0 {
		c.MaxBodyReads = DefaultMaxBodyReads
	}
	if c.MaxBodyReadsPerConn == 0 {
		c.MaxBodyReadsPerConn = DefaultMaxBodyReadsPerConn
	}
	if c.H2MaxConcurrentStreams == 0 {
		c.H2MaxConcurrentStreams = DefaultH2MaxConcurrentStreams
	}
}

func validateLimits(c *Config) []error {
	var errs []error
	if c.RedisURL == "" && len(c.RedisClusterAddrs) == 0 {
		errs = append(errs, errors.New("a Redis URL (--redis-url) or cluster addresses (--redis-cluster) are required: limits fail closed without Redis"))
	}
	if c.RedisURL != "" && len(c.RedisClusterAddrs) == 0 {
		if _, err := redispipe.ParseURL(c.RedisURL); err != nil {
			errs = append(errs, err)
		}
	}
	if strings.ContainsAny(c.RedisKeyPrefix, "{}") {
		errs = append(errs, fmt.Errorf("redis key prefix %q must not contain '{' or '}'", c.RedisKeyPrefix))
	}
	if c.LimitsCallTimeout < 0 || c.LeaseTTL < 0 {
		errs = append(errs, errors.New("limits call timeout and lease TTL must not be negative"))
	}
	if c.BudgetSeedWait < 0 {
		errs = append(errs, fmt.Errorf("budget seed wait %s must not be negative", c.BudgetSeedWait))
	}
	if c.LeaseTTL > 0 && c.LeaseTTL <= limits.DefaultRenewInterval {
		errs = append(errs, fmt.Errorf("lease TTL %s must exceed the renew interval %s", c.LeaseTTL, limits.DefaultRenewInterval))
	}
	if c.RateLimitFallback != RateFallbackClosed && c.RateLimitFallback != RateFallbackLocal {
		errs = append(errs, fmt.Errorf("rate limit fallback %q: want %s or %s", c.RateLimitFallback, RateFallbackClosed, RateFallbackLocal))
	}
	if c.DefaultMaxOutputTokens < 0 {
		errs = append(errs, errors.New("default max output tokens must not be negative"))
	}
	return errs
}

// validateServer reports the problems of the server settings (zero means
// the default).
func validateServer(c *Config) []error {
	var errs []error
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"read header timeout", c.ReadHeaderTimeout}, {"idle timeout", c.IdleTimeout}, {"body read timeout", c.BodyReadTimeout}} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("%s %s: must not be negative", d.name, d.v))
		}
	}
	for _, n := range []struct {
		name string
		v    int
	}{{"max body reads", c.MaxBodyReads}, {"max body reads per connection", c.MaxBodyReadsPerConn}, {"h2 max concurrent streams", c.H2MaxConcurrentStreams}} {
		if n.v < 0 {
			errs = append(errs, fmt.Errorf("%s %d: must not be negative", n.name, n.v))
		}
	}
	if c.MaxBodyReads > 0 && c.MaxBodyReadsPerConn > c.MaxBodyReads {
		errs = append(errs, fmt.Errorf("max body reads per connection %d: must not exceed max body reads %d", c.MaxBodyReadsPerConn, c.MaxBodyReads))
	}
	if c.H2MaxConcurrentStreams > 1<<20 {
		errs = append(errs, errors.New("h2 max concurrent streams: at most 1048576"))
	}
	return errs
}

func orDefault(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}
