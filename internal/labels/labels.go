// Package labels holds the rules for the project and tags a request
// carries (a key's, or a JWT's mapped from its claims, docs/jwt.md), which
// project and tag scopes limit (docs/tenancy.md). They are the admin API's
// rules for keys and label scopes (controlplane/internal/admin: keys.go,
// labelscopes.go), shared here so the data plane checks claim values the
// same way.
package labels

import (
	"fmt"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"
)

const (
	// MaxProjectLen is the most characters of a project.
	MaxProjectLen = 100
	// MaxTags is the most tags of one request; MaxTagLen of one tag.
	MaxTags   = 64
	MaxTagLen = 64
)

var tagPattern = regexp.MustCompile(`^[A-Za-z0-9_.:/-]{1,64}$`)

// Project checks a non-empty project name: 1–100 characters of valid
// UTF-8, no surrounding spaces or control characters.
func Project(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("empty")
	case !utf8.ValidString(name) || utf8.RuneCountInString(name) > MaxProjectLen:
		return fmt.Errorf("must be 1–%d characters of valid UTF-8", MaxProjectLen)
	case strings.TrimSpace(name) != name:
		return fmt.Errorf("must not start or end with spaces")
	case strings.IndexFunc(name, unicode.IsControl) >= 0:
		return fmt.Errorf("must not contain control characters")
	}
	return nil
}

// Tag checks one tag: 1–64 characters of A-Z a-z 0-9 _ . : / -.
func Tag(t string) error {
	if !tagPattern.MatchString(t) {
		return fmt.Errorf("tag %q must be 1–%d characters of A-Z a-z 0-9 _ . : / -", t, MaxTagLen)
	}
	return nil
}

// Tags checks a request's tags: at most 64, each a Tag, no duplicates.
func Tags(tags []string) error {
	if len(tags) > MaxTags {
		return fmt.Errorf("at most %d tags (got %d)", MaxTags, len(tags))
	}
	seen := make(map[string]bool, len(tags))
	for _, t := range tags {
		if err := Tag(t); err != nil {
			return err
		}
		if seen[t] {
			return fmt.Errorf("duplicate tag %q", t)
		}
		seen[t] = true
	}
	return nil
}
