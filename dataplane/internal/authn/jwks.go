package authn

import (
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-jose/go-jose/v4"
)

// JWKS defaults (docs/jwt.md).
const (
	// DefaultJWKSRefreshInterval is how often the keys of every issuer in
	// use are fetched again in the background.
	DefaultJWKSRefreshInterval = time.Minute
	// DefaultJWKSMinRefresh bounds fetches triggered by unknown kids: at
	// most one per issuer per interval, so that tokens with made-up kids
	// cannot make the proxy hammer the issuer.
	DefaultJWKSMinRefresh = 10 * time.Second
	// DefaultJWKSMaxStale is how long the last good keys of an issuer are
	// used while its JWKS cannot be fetched; past it its tokens are
	// refused (fail closed: a revoked signing key must stop working).
	DefaultJWKSMaxStale = 5 * time.Minute
	// DefaultJWKSFetchTimeout bounds one fetch (discovery and keys).
	DefaultJWKSFetchTimeout = 3 * time.Second
	// maxJWKSBytes bounds a discovery document or key set.
	maxJWKSBytes = 1 << 20
	// idleSources: a source no token asked for in this many refresh
	// intervals is dropped (its issuer was deleted or is unused).
	idleSources = 60
)

// Errors of JWKS.Key.
var (
	// ErrUnknownKID: the issuer's current keys hold no key of that id.
	ErrUnknownKID = errors.New("no signing key with this kid")
	// ErrKeysUnavailable: the issuer's keys could not be fetched and the
	// last good ones are older than the stale bound (or there are none).
	ErrKeysUnavailable = errors.New("the issuer's signing keys are unavailable")
)

// JWKSConfig configures a JWKS cache; zero fields take the defaults.
type JWKSConfig struct {
	Client          *http.Client
	RefreshInterval time.Duration
	MinRefresh      time.Duration
	MaxStale        time.Duration
	FetchTimeout    time.Duration
	Logger          *slog.Logger
}

// JWKS caches the signing keys of trusted issuers (by JWKS URL, or by
// issuer for OIDC discovery). Tokens are verified from memory; a fetch on
// the request path happens only for a kid the cache does not know, at
// most once per MinRefresh per source, all waiting requests sharing it.
// Run refreshes the sources in use every RefreshInterval.
type JWKS struct {
	cfg JWKSConfig
	log *slog.Logger

	mu      sync.Mutex
	sources map[string]*source
}

// source is one issuer's key set. Fields are guarded by JWKS.mu.
type source struct {
	jwksURL, issuer string // jwksURL "" → discovery from issuer
	keys            map[string]jose.JSONWebKey
	good            time.Time     // last successful fetch
	attempt         time.Time     // last fetch started
	fetching        chan struct{} // closed when the fetch in flight ends
	used            time.Time
	err             error // of the last fetch
}

// NewJWKS returns a cache.
func NewJWKS(cfg JWKSConfig) (*JWKS, error) {
	if cfg.Client == nil {
		cfg.Client = &http.Client{}
	}
	if cfg.RefreshInterval == 0 {
		cfg.RefreshInterval = DefaultJWKSRefreshInterval
	}
	if cfg.MinRefresh == 0 {
		cfg.MinRefresh = DefaultJWKSMinRefresh
	}
	if cfg.MaxStale == 0 {
		cfg.MaxStale = DefaultJWKSMaxStale
	}
	if cfg.FetchTimeout == 0 {
		cfg.FetchTimeout = DefaultJWKSFetchTimeout
	}
	if cfg.RefreshInterval < 0 || cfg.MinRefresh < 0 || cfg.MaxStale < 0 || cfg.FetchTimeout < 0 {
		return nil, errors.New("jwks: intervals must not be negative")
	}
	if cfg.MaxStale <= cfg.RefreshInterval {
		return nil, fmt.Errorf("jwks: the stale bound (%s) must exceed the refresh interval (%s)", cfg.MaxStale, cfg.RefreshInterval)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &JWKS{cfg: cfg, log: log, sources: map[string]*source{}}, nil
}

func sourceID(jwksURL, issuer string) string {
	if jwksURL != "" {
		return "jwks " + jwksURL
	}
	return "discovery " + issuer
}

// Key returns the key kid of the issuer (its JWKS at jwksURL, or found by
// discovery from issuer when jwksURL is ""): ErrUnknownKID,
// ErrKeysUnavailable.
func (j *JWKS) Key(ctx context.Context, jwksURL, issuer, kid string) (jose.JSONWebKey, error) {
	id := sourceID(jwksURL, issuer)
	j.mu.Lock()
	s := j.sources[id]
	if s == nil {
		s = &source{jwksURL: jwksURL, issuer: issuer}
		j.sources[id] = s
	}
	now := time.Now()
	s.used = now
	fresh := !s.good.IsZero() && now.Sub(s.good) < j.cfg.MaxStale
	if k, ok := s.keys[kid]; ok && fresh {
		j.mu.Unlock()
		return k, nil
	}
	// Unknown kid, or no usable keys: refresh, rate-bounded.
	wait := s.fetching
	if wait == nil && (s.attempt.IsZero() || now.Sub(s.attempt) >= j.cfg.MinRefresh) {
		wait = j.startFetchLocked(s)
	}
	j.mu.Unlock()
	if wait != nil {
		select {
		case <-wait:
		case <-ctx.Done():
			return jose.JSONWebKey{}, ErrKeysUnavailable
		}
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if s.good.IsZero() || time.Since(s.good) >= j.cfg.MaxStale {
		return jose.JSONWebKey{}, ErrKeysUnavailable
	}
	if k, ok := s.keys[kid]; ok {
		return k, nil
	}
	return jose.JSONWebKey{}, ErrUnknownKID
}

// startFetchLocked starts a fetch of s (j.mu held) and returns the
// channel closed when it ends.
func (j *JWKS) startFetchLocked(s *source) chan struct{} {
	done := make(chan struct{})
	s.fetching, s.attempt = done, time.Now()
	jwksURL, issuer := s.jwksURL, s.issuer
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), j.cfg.FetchTimeout)
		defer cancel()
		keys, err := j.fetch(ctx, jwksURL, issuer)
		j.mu.Lock()
		s.fetching, s.err = nil, err
		if err == nil {
			s.keys, s.good = keys, time.Now()
		}
		j.mu.Unlock()
		close(done)
		if err != nil {
			j.log.Warn("jwks fetch failed; keeping the last good keys within the stale bound",
				"issuer", issuer, "jwks_url", jwksURL, "error", err)
		}
	}()
	return done
}

// Run refreshes every source in use each RefreshInterval until ctx ends,
// and drops sources idle for idleSources intervals.
func (j *JWKS) Run(ctx context.Context) error {
	t := time.NewTicker(j.cfg.RefreshInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		j.mu.Lock()
		var waits []chan struct{}
		for id, s := range j.sources {
			if time.Since(s.used) > idleSources*j.cfg.RefreshInterval {
				delete(j.sources, id)
				continue
			}
			if s.fetching == nil {
				waits = append(waits, j.startFetchLocked(s))
			}
		}
		j.mu.Unlock()
		for _, w := range waits {
			select {
			case <-w:
			case <-ctx.Done():
				return nil
			}
		}
	}
}

func (j *JWKS) fetch(ctx context.Context, jwksURL, issuer string) (map[string]jose.JSONWebKey, error) {
	if jwksURL == "" {
		var doc struct {
			Issuer  string `json:"issuer"`
			JWKSURI string `json:"jwks_uri"`
		}
		if err := j.getJSON(ctx, strings.TrimSuffix(issuer, "/")+"/.well-known/openid-configuration", &doc); err != nil {
			return nil, fmt.Errorf("discovery: %w", err)
		}
		if doc.Issuer != issuer {
			return nil, fmt.Errorf("discovery: the document names issuer %q, want %q", doc.Issuer, issuer)
		}
		if doc.JWKSURI == "" {
			return nil, errors.New("discovery: no jwks_uri")
		}
		jwksURL = doc.JWKSURI
	}
	var set struct {
		Keys []json.RawMessage `json:"keys"`
	}
	if err := j.getJSON(ctx, jwksURL, &set); err != nil {
		return nil, fmt.Errorf("jwks: %w", err)
	}
	keys := make(map[string]jose.JSONWebKey, len(set.Keys))
	for _, raw := range set.Keys {
		var k jose.JSONWebKey
		if err := k.UnmarshalJSON(raw); err != nil {
			continue // a key type this build does not know: skip it, keep the others
		}
		if usable(k) {
			keys[k.KeyID] = k
		}
	}
	return keys, nil
}

// usable: a public signature key (never a symmetric one: an HMAC secret
// has no place in a JWKS, and accepting one would let HS256 tokens be
// "verified" with public material).
func usable(k jose.JSONWebKey) bool {
	if !k.Valid() || !k.IsPublic() || (k.Use != "" && k.Use != "sig") {
		return false
	}
	switch k.Key.(type) {
	case *rsa.PublicKey, *ecdsa.PublicKey, ed25519.PublicKey:
		return true
	}
	return false
}

func (j *JWKS) getJSON(ctx context.Context, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := j.cfg.Client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: status %d", url, resp.StatusCode)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxJWKSBytes+1))
	if err != nil {
		return err
	}
	if len(b) > maxJWKSBytes {
		return fmt.Errorf("GET %s: more than %d bytes", url, maxJWKSBytes)
	}
	return json.Unmarshal(b, v)
}

// algorithmsOf returns the signature algorithms a key may verify: its
// "alg" when the JWKS sets one, else those of its type (and curve).
func algorithmsOf(k jose.JSONWebKey) []jose.SignatureAlgorithm {
	if k.Algorithm != "" {
		return []jose.SignatureAlgorithm{jose.SignatureAlgorithm(k.Algorithm)}
	}
	switch pk := k.Key.(type) {
	case *rsa.PublicKey:
		return []jose.SignatureAlgorithm{jose.RS256, jose.RS384, jose.RS512, jose.PS256, jose.PS384, jose.PS512}
	case *ecdsa.PublicKey:
		switch pk.Curve {
		case elliptic.P256():
			return []jose.SignatureAlgorithm{jose.ES256}
		case elliptic.P384():
			return []jose.SignatureAlgorithm{jose.ES384}
		case elliptic.P521():
			return []jose.SignatureAlgorithm{jose.ES512}
		}
	case ed25519.PublicKey:
		return []jose.SignatureAlgorithm{jose.EdDSA}
	}
	return nil
}
