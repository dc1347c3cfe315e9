package vllmsim

import (
	"strings"
	"unicode/utf8"
)

// TokenID identifies a token of the simulator's vocabulary. Every ID is below
// VocabSize.
type TokenID uint32

// VocabSize is the size of the simulated vocabulary. Ordinary pieces hash into
// [0, VocabSize-numSpecialTokens); the special tokens take the top IDs.
const VocabSize = 131072

// Special tokens of the simulated chat template (ChatML, as used by Qwen).
// Each is always a single token.
const (
	// TokenIMStart opens a chat message: "<|im_start|>".
	TokenIMStart TokenID = VocabSize - 1
	// TokenIMEnd closes a chat message and is the end-of-sequence token the
	// simulated model samples when it stops: "<|im_end|>".
	TokenIMEnd TokenID = VocabSize - 2
	// TokenEndOfText is "<|endoftext|>".
	TokenEndOfText TokenID = VocabSize - 3

	numSpecialTokens = 16
)

const (
	imStart   = "<|im_start|>"
	imEnd     = "<|im_end|>"
	endOfText = "<|endoftext|>"

	// maxLetterRun is how many letters (runes) one word piece holds, not
	// counting its optional leading space.
	maxLetterRun = 4
	// maxDigitRun is how many digits one number piece holds.
	maxDigitRun = 3
	// maxSpaceRun is how many whitespace bytes one whitespace piece holds.
	maxSpaceRun = 4
)

// Tokenize splits text into tokens with the simulator's deterministic
// tokenizer and returns their IDs. See the package documentation for the
// rules; they give roughly one token per four characters of English and have
// the property the prefix cache needs: the tokens of a text that ends in a
// newline are a prefix of the tokens of any continuation of it.
func Tokenize(text string) []TokenID {
	ids := make([]TokenID, 0, len(text)/4+1)
	forEachPiece(text, func(piece string) {
		ids = append(ids, pieceID(piece))
	})
	return ids
}

// CountTokens returns len(Tokenize(text)) without allocating the IDs.
func CountTokens(text string) int {
	n := 0
	forEachPiece(text, func(string) { n++ })
	return n
}

// Pieces returns the text of each token of text; joined, they give text back.
func Pieces(text string) []string {
	var out []string
	forEachPiece(text, func(piece string) { out = append(out, piece) })
	return out
}

// pieceID maps a piece to its token ID: the special tokens have fixed IDs,
// every other piece is hashed (FNV-1a, 32 bits) into the ordinary range.
func pieceID(piece string) TokenID {
	switch piece {
	case imStart:
		return TokenIMStart
	case imEnd:
		return TokenIMEnd
	case endOfText:
		return TokenEndOfText
	}
	h := uint32(2166136261)
	for i := 0; i < len(piece); i++ {
		h ^= uint32(piece[i])
		h *= 16777619
	}
	return TokenID(h % (VocabSize - numSpecialTokens))
}

func isASCIILetter(c byte) bool { return c|0x20 >= 'a' && c|0x20 <= 'z' }
func isDigit(c byte) bool       { return c >= '0' && c <= '9' }
func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}

// isLetterAt reports whether a letter (an ASCII letter or any non-ASCII rune)
// starts at s[i], and its width in bytes.
func isLetterAt(s string, i int) (bool, int) {
	c := s[i]
	if c < utf8.RuneSelf {
		return isASCIILetter(c), 1
	}
	_, w := utf8.DecodeRuneInString(s[i:])
	return true, w
}

// specialAt returns the special token starting at s[i], if any.
func specialAt(s string, i int) string {
	if i+1 >= len(s) || s[i] != '<' || s[i+1] != '|' {
		return ""
	}
	for _, sp := range [...]string{imStart, imEnd, endOfText} {
		if strings.HasPrefix(s[i:], sp) {
			return sp
		}
	}
	return ""
}

// forEachPiece calls fn with every piece of s, in order. The rules, applied at
// each position:
//
//  1. a special token ("<|im_start|>", "<|im_end|>", "<|endoftext|>") is one piece;
//  2. a single space directly before a non-space character that does not
//     start a special token is glued to the front of the next piece;
//  3. letters (ASCII letters or any non-ASCII rune): up to 4 per piece;
//  4. digits: up to 3 per piece;
//  5. a newline is a piece of its own;
//  6. other whitespace: a run of up to 4 bytes per piece, leaving a trailing
//     space that precedes a non-space character for rule 2;
//  7. any other byte (punctuation, symbols) is a piece of its own.
//
// Because a newline never merges with what follows, the tokens of a text
// ending in a newline are a prefix of the tokens of any continuation of it.
func forEachPiece(s string, fn func(string)) {
	i := 0
	for i < len(s) {
		if sp := specialAt(s, i); sp != "" {
			fn(sp)
			i += len(sp)
			continue
		}
		start := i
		if s[i] == ' ' && i+1 < len(s) && !isSpace(s[i+1]) && specialAt(s, i+1) == "" {
			i++ // rule 2: the space belongs to the piece that follows
		}
		c := s[i]
		switch {
		case isDigit(c):
			n := 0
			for i < len(s) && n < maxDigitRun && isDigit(s[i]) {
				i++
				n++
			}
		case c == '\n':
			i++ // rule 5: a newline is always a token of its own
		case isSpace(c):
			j := i
			for j < len(s) && isSpace(s[j]) && s[j] != '\n' {
				j++
			}
			// Leave a final space before a non-space character to the next piece.
			if j < len(s) && j-1 > i && s[j-1] == ' ' && specialAt(s, j) == "" {
				j--
			}
			if j-i > maxSpaceRun {
				j = i + maxSpaceRun
			}
			i = j
		default:
			if ok, _ := isLetterAt(s, i); ok {
				n := 0
				for i < len(s) && n < maxLetterRun {
					ok, w := isLetterAt(s, i)
					if !ok {
						break
					}
					i += w
					n++
				}
			} else {
				i++
			}
		}
		fn(s[start:i])
	}
}
