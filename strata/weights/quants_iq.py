"""Block decoders for the i-quants (IQ1_S … IQ4_XS) and their codebooks.

The 2- and 3-bit i-quants store, per 8 (or 4) weights, an index into a fixed codebook ("grid") of magnitudes,
plus sign bits and a scale. The grids below are ggml's tables (ggml-common.h, MIT licence), in the packed form
the gguf package uses: each grid value is a 2-bit (3-bit for IQ3) code into a short list of levels, four (two)
codes per byte from the low bits up, and the bytes are base64 encoded here to keep the module small. The sign
table `ksigns` is built from its definition. tests/test_quants.py checks every table against the gguf package.

Each decoder maps (n, type_size) uint8 blocks to (n, 256) float32, bit-identical to ggml's reference code.
"""

from __future__ import annotations

import base64

import torch
from torch import Tensor

from strata.weights.quants_k import (
    bits,
    f16_at,
    f16_from_bits,
    ints,
    iq4nl_byte_levels,
    iq4nl_values,
    lookup,
    u16_at,
    u32_at,
)

# --- codebooks --------------------------------------------------------------------------------------------------

_IQ2XXS_B64 = (
    "AAACAAUACAAKABEAFAAgACIAKAAqAEEARABQAFgAYQBkAIAAggCKAKIAAQEEARABFQFAAYQBmAEAAgICIgKCAgEEBAQQBCEEJARA"
    "BEIESARgBIEEhASQBKQEAAUCBQgFIAVGBWkFgAWRBQkGEAZABoQGpAYACAUICAgUCCgIQQhECFAIUgiICAQJQAkCChQKARAEEBAQ"
    "IRBAEGAQhBCQEJUQABEIESARUBFaEYARJBJFEgAUCBQgFCUUSRSAFBgVYhUAFhYWARgEGBAYQBiBGAAZBRmgGVEaACACIAogRCBh"
    "IIAggiApIUghACICIgEkBCQQJEAkViQAJUElZCWQJggoICiUKEQqAUAEQBBAGEAhQCRAQEBIQFZAYECBQIRAkEAAQSBBYUGAQYVB"
    "AUIQQkhCVkJoQgBECEQgRIBEmUQSRSRFAEYBSARIEEhASEVIAElYSWFJgklFSpBKAFAIUBFQGVAgUIBQiFAEUUJRpFGRUpBUklQK"
    "VQFWVFYAWBFYGVhkWEBZCFoEYBBgQGBoYABhVWEYYmBiAGQFZBBlEmWEZUJoAIACgAqAQYCCgASBGIFAgRGCAYQEhBCEFYRAhGCE"
    "AIVGhZSFCYZAhmCGAogEiRGKBJAQkCSQQJChkBaRgJFFkgCUIpRElFGVgZggmQKgUKCFoAmhAKIYpFCoBKk="
)
_IQ2XS_B64 = (
    "AAACAAUACAAKABEAFAAWABkAIAAiACUAKABBAEQARgBJAFAAUgBVAFgAYQBkAIAAggCFAIgAkQCUAJkAoAABAQQBBgEJARABEgEV"
    "ARgBGgEhASQBQAFCAUUBSAFRAVQBYAFoAYEBhAGQAQACAgIFAggCEQIUAiACQQJEAlACVQKAAooCAQQEBAYECQQQBBIEFQQYBCEE"
    "JARABEIERQRIBFEEVARWBGAEgQSEBJAEAAUCBQUFCAURBRQFIAVBBUQFUAVhBYAFAQYEBhAGJgZABkIGhAYACAIIBQgICAoIEQgU"
    "CCAIJQhBCEQIUAhYCIAIoAiqCAEJBAkQCUAJgQmJCQAKIAooCpYKoAoBEAQQBhAJEBAQEhAVEBgQIRAkEEAQQhBFEEgQURBUEGAQ"
    "ahCBEIQQkBAAEQIRBREIERERFBEgEUERRBFQEYARlBGWEQESBBIGEhASQBJgEgAUAhQFFAgUERQUFCAUQRREFEkUUBRkFIAUARUE"
    "FRAVQBUAFhQWSRYBGAQYEBgSGEAYVBiGGAAZBRlmGVEaqRoAIAIgBSAIIAogESAUICAgQSBEIFAggCCgIAEhBCEQIUAhSCFlIQAi"
    "IiKAIqgiASQEJBAkKSRAJAAlQSVSJZklASYaJqYmACgIKAooIChVKIgooihoKZApCCogKoIqiCqKKgFABEAGQAlAEEASQBVAGEAh"
    "QCRAQEBCQEVASEBKQFFAVEBgQGVAgUCEQJBAAEECQQVBCEERQRRBIEFBQURBUEGAQYVBokEBQgRCEEISQilCQEIARAJEBUQIRBFE"
    "FEQZRCBEQURERFBEgESURAFFBEUQRSRFQEWaRQBGCkZERlBGAUgESBBIQEhFSFRIYkgASRFJRElQSWlJBEoAUAJQBVAIUBFQFFAg"
    "UChQQVBEUFBQgFABUQRREFEVUUBRQlEAUkRSqlIBVARUEFQhVEBUYFSBVKFUAFUIVYBViFUhVmhWoVYAWBRYQVhQWJlYGllAWUJZ"
    "hVoBYARgEGBAYFRgYmCGYKlgAGEkYkpikmIAZBZkEGVAZUVlpGUBaGpoJWkGalRqYmoAgAKABYAIgBGAFIAggCqAQYBEgFCAgICC"
    "gKiAqoABgQSBBoEQgUCBUYFZgQCCIIKAgoKCoIKoggGEBIQQhBKEFYRAhGCEiYQAhUSFpYUYhmqGAIgIiCWIWoiAiIKIqIgGiSKK"
    "gIqIipaKqIoBkASQEJBAkFaQhJAAkSKRZJFWkomSAJQFlESUUJRYlCmVkJWSlUGWUZimmEmZFZpgmgCgAqAIoAqgIKAqoKCgUaFZ"
    "oaahAKICogiiKqKAoqCiQKSVpGWmmKYKqCCoIqgoqKCoqKgEqYSphqkoqiqqkaqqqg=="
)
_IQ2S_B64 = (
    "AAACAAUACAAKABEAFAAWABkAIAAiACUAKABBAEQARgBJAFAAUgBVAFgAYQBkAGYAaQCAAIIAhQCIAJEAlACgAKUAqgABAQQBBgEJ"
    "ARABEgEVARgBIQEkAUABQgFFAUgBUQFUAVYBWQFgAWUBaAGBAYQBkAGSAZUBoQGkAQACAgIFAggCEQIUAiACKgJBAkQCRgJJAlAC"
    "VQKAAoUCigKUAqICAQQEBAYECQQQBBIEFQQYBCEEJAQmBCkEQARCBEUESARKBFEEVARWBFkEYARiBGUEgQSEBIYEiQSQBJUEmASh"
    "BKQEAAUCBQUFCAUKBREFFAUWBRkFIAUlBSgFQQVEBUYFSQVQBVIFVQVYBWEFZAWABYIFhQWIBZEFlAWgBQEGBAYGBgkGEAYVBkAG"
    "RQZIBlEGVAZgBoEGhAaQBgAIAggFCAgIEQgUCBYIGQggCCUIKghBCEQIRghJCFAIUghVCFgIYQhkCIAIhQiUCKoIAQkECRAJEgkV"
    "CRgJIQlACUUJSAlRCVQJYAmBCZAJAAoRChQKIgooCioKUAqZCgEQBBAGEAkQEBASEBUQGBAhECQQJhBAEEIQRRBIEFEQVBBWEFkQ"
    "YBBiEGUQaBCBEIQQhhCQEJUQmBChEKQQABECEQURCBEKERERFBEWERkRIBEiESURKBFBEUQRRhFJEVARUhFVEVgRYRFkEYARghGF"
    "EYgRkRGUEQESBBIJEhASFRIhEiQSQBJFElESVBKBEoQSkBIAFAIUBRQIFBEUFBQWFBkUIBQlFCgUQRREFEYUSRRQFFIUVRRYFGEU"
    "ZBSAFIIUhRSIFJEUlBSgFAEVBBUGFQkVEBUSFRUVGBUhFSQVQBVCFUUVSBVRFVQVYBWBFYQVkBUAFgUWCBYRFhQWIBZBFkQWUBaA"
    "FqoWARgEGAYYCRgQGBUYGBghGEAYQhhFGEgYURhUGGAYgRiEGAAZAhkFGQgZERkUGSAZQRlEGVAZaRmiGQQaEBpAGlYaACACIAUg"
    "CCARIBQgFiAZICAgJSAqIEEgRCBQIFIgVSBkIIAgiiCUIKogASEEIRAhEiEVISEhQCFCIUUhUSFUIWAhgSGEIZAhACIKIiIiKCIq"
    "IkQiUCKIIooiqCIBJAQkBiQJJBAkFSQYJCEkJCRAJEIkRSRIJFEkVCRgJIEkhCSQJAAlBSUIJRElFCUgJUElRCVQJWYlgCUBJgQm"
    "ECZAJlkmACgFKBEoFChBKEQoUCiKKKooASkEKRAplSkKKiIqZCqIKooqAUAEQAZACUAQQBJAFUAYQBpAIUAkQCZAQEBCQEVASEBK"
    "QFFAVEBWQFlAYEBiQGVAgUCEQJBAlUCYQKFApEAAQQJBBUEIQRFBFEEWQRlBIEEiQSVBQUFEQUZBSUFQQVJBVUFYQWFBZEGAQYJB"
    "hUGIQZFBlEGgQQFCBEIQQhJCFUIYQiRCQEJFQkhCUUJUQmBCgUKEQgBEAkQFRAhECkQRRBREFkQZRCBEIkQlRChEQUREREZESURQ"
    "RFJEVURYRGFEZESARIJEhUSIRJFElESgRAFFBEUGRQlFEEUSRRVFGEUhRSRFQEVCRUVFSEVRRVRFYEVqRYFFhEWQRQBGAkYFRghG"
    "EUYURiBGQUZERlBGgEalRgFIBEgJSBBIEkgVSBhIIUgkSEBIQkhFSEhIUUhUSGBIhEiQSABJAkkFSQhJEUkUSSBJQUlESVBJgEmW"
    "SQFKBEoQSkBKAFACUAVQCFARUBRQFlAZUCBQIlAlUChQQVBEUEZQSVBQUFJQVVBYUGFQZFCAUIJQhVCIUJFQlFABUQRRBlEJURBR"
    "ElEVURhRIVEkUUBRQlFFUUhRUVFUUWBRgVGEUZBRAFIFUghSEVIUUiBSQVJEUlBSaVKAUgFUBFQGVAlUEFQSVBVUGFQhVCRUQFRC"
    "VEVUSFRRVFRUYFSBVIRUkFQAVQJVBVUIVRFVFFUgVUFVRFVQVYBVAVYEVhBWJlZAVgBYAlgFWAhYEVgUWCBYQVhEWFBYWliAWAFZ"
    "BFkQWUBZAFoZWoVaqFoBYARgBmAQYBJgFWAYYCFgJGBAYEVgSGBRYFRgYGCEYJBgAGECYQVhCGERYRRhIGFBYURhUGGAYZlhBGIQ"
    "YkBiVmKhYgBkBWQIZBFkFGQgZEFkRGRQZIBkAWUEZRBlQGVKZWhlkmUAZpRmAWgEaBBoZWiYaABpKmlCaqFqAIACgAWACIARgBSA"
    "GYAggCWAQYBEgFCAUoBVgFiAYYCAgIWAkYCUgAGBBIEJgRCBEoEVgRiBIYEkgUCBQoFFgUiBUYFUgYGBhIGQgamBAIIFggqCEYIU"
    "gkGCRIJQggGEBIQGhAmEEIQShBWEGIQhhECEQoRFhEiEUYRUhGCEgYSEhJCEAIUChQWFCIURhRSFIIVBhUSFUIWAhYqFAYYEhhCG"
    "KYZAhgCIBYgRiBSIQYhEiFCIoogBiQSJQIlliSKKWIpaioKKoooBkASQCZAQkBKQFZAYkCSQQJBCkEWQSJBRkFSQYJCBkISQkJAA"
    "kQWREZEUkUGRRJFQkVqRAZIEkhCSQJKmkgCUApQFlAiUEZQUlCCUQZRElFCUgJSWlAGVBJUQlUCVmJWhlQCWRpZklgGYBJgQmCaY"
    "QJipmACZSZlSmZCaAKAFoAqgFKAioCqgQaBEoFCgoqCqoEChZaECogqiIqIooiqigqKIooqiqKIBpASkEKRApImkpKQApRmlUaYK"
    "qCiooqhUqYapCKoKqiCqIqooqoiqqqo="
)
_IQ3XXS_B64 = (
    "AAACAAQAEQATABcAIAAiADEAQgBzAHUAAQEDARABEgEhASUBMAEyAUEBVAFwAQACAgIEAhECIAIiAjECMwI3AlECVwJ1AgEDBwMQ"
    "AxIDJQNwAxMENwREBFcEcwR1BAEFBwUyBVIFNQZkBhAHFAcWB0MHYQcBEAMQEBASECEQIxAwEDIQNBBHEFAQABECERERIBEiEQES"
    "AxIQEhISIRIwEnISABMCEyATMRNGE2YTARQFFFAUIBUkFUYVcRUFFiIXQBcAIAIgESATICAgIiAmIDEgQiABIQMhBSEQIRIhISEw"
    "IWMhZyFwIQAiAiIRIhciICIiIjciQCJVIgEjECMUI3AjdCM1JFMkAyUnJUEldCUBJwMnFidFJwEwEDASMCEwIzBQMGUwcjAAMQIx"
    "IDExMUQxRjEBMgMyEDIlMlIycjIRMzMzMDRHNHI0ADUGNSI1VTUUNjY2YzYzN2A3BEAXQDVAN0BTQFdAdEEgQjdCQEJgQmZCB0NF"
    "QwREUURkRCVFQ0VwRQVHEEcSRzBHElBBUHBQAFEGUSZRVVEUUjJSclICU1NTEFQjVCdUclQCVTFVUFYkV0JXJGBEYEZgZGAhYWFh"
    "F2JkYjBjNmNEZAVlUmUzZgNnIWcDcAVwB3AQcDJwUnAmcUBxEnJFclJyAHMVczNzYHMhdEF0AHUCdSR1MHY="
)
_IQ3S_B64 = (
    "AAABAAIABQAHABAAEQASABQAFgAgACEAJQAzAEAAQgBFAEcAUQBTAGAAYgBxAHQAdwAAAQEBAgEEARABEQEVASABIwEnATEBNQFE"
    "AWEBZQFyAQACAQIFAgcCEAITAhYCIQIlAjACNAJCAkUCRwJRAlMCcAJzAgMDEQMVAyADIgMxAzMDNgNEA1ADUgNnA3EDdQMABBME"
    "FwQhBCQEMgRABEMEUQRwBAIFBAUgBSIFJgUzBUEFRQVHBWYFcwUGBhEGEwYxBlIGcQYABwIHBAcgByIHJgczB1AHVAcAEAEQAhAE"
    "EBAQERATEBUQFxAgECIQMRA0EDYQVBBWEGEQchAAEQERAxEGERARFBEhETARMxFBEVARUhFwEXYRABISEhUSFxIgEiQSMhJAEkMS"
    "VRJgEnISARMEEwcTEBMTEyETJxMwEzQTQRNiE3ATAxQFFBIUFBQxFDMUQhRGFFAUVBQBFRAVExUhFTAVMhVRFSAWJBYnFkQWRhYB"
    "FwMXEBcSFyEXNRdBF2IXcBcAIAEgAyAFIAcgECASIBQgFiAhICMgJyAwIDIgQSBDIEUgUCBSIGcgcCBzIHUgACECIRAhEyEXISIh"
    "JSExITQhQiFRIQEiBCIHIiEiIyIwIjciQSJTIlcicSJ0IgAjAiMFIxEjIiMkIzEjMyNCI1AjZiMBJAckICQjJDIkNSRBJHIkdSQE"
    "JRElIiU3JUAlUyVwJQAmAiYHJiEmVSZhJgUnEScmJzAnQydQJwIwETATMBUwFzAiMDEwMzA1MEIwRDBHMFEwYzBxMAExAzEFMRQx"
    "ITEjMUAxYDFyMXYxADISMiAyMjI0MlAyATMQMxQzITMjMyczMDNBM0MzRzNVM3MzAzQRNBY0IjQxNFI0YDRkNAE1EDUSNSU1MjVE"
    "NVY1czUWNkE2ATcDNyA3Ijc1NwBABEASQCBAJEAnQDJAQUBQQHBAAkEHQRFBE0EiQTBBNUFDQVFBVUEBQgNCEEIVQiFCM0JAQldC"
    "YkJwQgRDEUMTQyBDIkMxQzVDAEQCRCREN0RARHFEBUUHRSFFYkUTRjRGYEYQRxVHMEdDR1FHAlAQUBRQIlBAUERQR1BSUGZQdFAB"
    "UQNRBVESUSFRMlFyUQBSEVIjUjBSNlJTUgJTB1MQUydTRFNRU2VTc1MBVARUIFQyVEZUElUmVVFVU1VCVgJXBFciVxFgE2AVYDFg"
    "M2BgYABhIGEnYWRhEmI0YkJiVWJiYnBiAGMUYyFjQGMlZENkYmQAZQNlNGVgZQVmQGYRZxNnAHAEcAdwIHAicDZwQHBUcGJwAnER"
    "cSRxQ3FFcQFyBHIQchZyIXIwclFyAnMyczVzU3MBdAV0E3QgdFB0InVCdQJ2MXYAdw=="
)
_IQ1S_B64 = (
    "AAACAAUACAAKABEAFQAgACIAKAAqAEUAUQBUAFYAZQCAAIIAiACKAJUAoACiAKgAqgAEAQUBEQEUARYBGQEaASUBQQFGAUkBUgFV"
    "AVoBYQFkAWYBaAGFAZEBlAGWAaUBAAICAggCCgIVAiACIgIoAioCRQJRAlkCZAJpAoACggKIAooCkQKVApkCoAKiAqgCqgIRBBQE"
    "FgQlBEEESQRVBFoEZARlBJEEmQSlBAEFBAUFBQYFFQUYBRoFKQVABUUFSgVQBVEFVAVVBVYFWQVgBWIFZQVoBWoFgQWRBZUFmAWa"
    "BaEFpAWlBaYFqQUUBhkGQQZEBlAGUgZVBlgGYAZhBmYGaQaFBpEGlAaZBgAIAggICAoIFQggCCIIKAgqCEUIUQhWCGUIgAiCCIgI"
    "igiVCKAIogioCKoIBQkRCRQJGQkkCSUJQQlQCVEJVQlhCWQJaQmRCZQJlgmZCaUJAAoCCggKCgoVCiAKIgooCioKRQpRClkKYQpl"
    "CoAKggqFCogKigqVCqAKogqoCqoKEBAREBQQGRAkECUQQRBEEFAQVRBYEGEQZBBlEGkQkRCUEJYQoRClEAERBBEGEQkREBESERUR"
    "GBEhESQRKRFFEUoRUBFREVIRVBFVEVYRWRFgEWURhBGSEZURoRGkERESFBIWEiUSQBJGEkkSUhJVElgSWhJkEmYShRKREpQSlhKl"
    "EgEUBhQJFBQUFRQYFBkUIRQmFEEURRRGFEgUShRRFFQUVRRWFFkUYhRlFGgUhBSJFJAUlBSVFJgUmRSaFKEUpBSlFKkUAhUFFQoV"
    "ERUUFRUVFhUZFSAVIhUlFSgVKhVBFUQVRRVGFVEVUhVUFVUVVhVZFVoVYRVkFWUVZhVpFYAVghWEFYUViBWKFZAVkRWUFZUVlhWZ"
    "FZoVoBWiFaUVARYEFgUWBhYVFhYWGBYaFiEWJhZAFkIWRBZFFkgWShZRFlUWVhZYFlkWYRZkFmUWaBZpFmoWhhaKFpIWlRakFqkW"
    "ERgWGCUYQRhEGEYYSRhQGFUYWBhaGGAYYRhkGGYYaRiFGJEYlBilGBAZEhkVGRoZIRklGUIZRBlFGUgZURlUGVUZVhlZGVoZYBll"
    "GWoZiRmRGZIZlRmYGaEZphmpGQkaFhokGiYaRBpGGkkaUBpSGlUaWBphGmYaaRqFGpEalhqaGgAgAiAIIAogFSAgICIgJSAoICog"
    "RSBRIFkgYSBlIIAggiCIIIoglSCgIKIgpSCoIKogBSERIRQhGSElIUIhRCFJIVUhWCFaIWEhZCFlIWYhhSGQIZYhmSGlIQEiCCIK"
    "IhEiFSIgIiIiKCIqIkUiUSJWIlkiZSKBIogiiiKRIpUioCKiIqgiqiIFJBQkFiQZJCUkRCRFJEYkSSRSJFUkWCRaJGYkhSSRJJQk"
    "mSShJKUkCSUVJSElKSVAJUUlSCVRJVQlVSVZJWIlZSVoJYklkCWUJZUlmCWaJaElpCWmJaklBSYQJhImGSYlJkEmSSZVJmAmYSZp"
    "JoQmhiaQJpomACgCKAgoCigVKCAoIigoKCooRShRKFQoZSiAKIIoiCiKKKAooiioKKooCSkRKRQpGSklKUYpSSlSKVUpYSlkKWYp"
    "aSmFKZAplimZKaQppSkAKgIqCCoKKiAqIiooKioqRSpRKlYqWSplKoAqgiqIKooqlSqgKqIqqCqqKgVAEUAWQCVASUBSQFVAWEBa"
    "QGFAZEBmQJRAmUChQKZAAEEBQQRBBkEJQRJBFUEWQRhBGkEhQSZBKUFFQUhBSkFRQVRBVUFWQVlBWkFlQWhBakGBQYRBhkGQQZJB"
    "lUGgQaFBokEFQhFCFEIWQiVCQUJSQlVCWkJkQmlCiUKUQqVCAUQVRBlEKURFREhESkRRRFREVURWRGFEYkRlRGhEakSBRIZEiUSQ"
    "RJJElUSgRKFEqUQBRQJFBUUKRRFFFEUVRRZFGUUgRSVFKkVBRURFRUVGRUlFUEVRRVRFVUVWRVhFWUVhRWRFZUVmRWlFgkWERYVF"
    "iEWRRZRFlUWWRZlFmkWlRahFqkUBRgVGCUYURhVGGEYaRiFGJEYpRkBGQkZFRkhGUEZRRlJGVUZWRllGYkZlRmhGgUaFRopGlEaV"
    "RqFGpEamRgVIEUgVSBpIJUhCSElIUEhVSFhIYUhkSGZIaUiFSJFIlEiWSJlIpUgBSQVJBkkKSRBJFEkVSRhJIUkkSSZJQElFSUpJ"
    "UUlSSVRJVUlWSVlJYEliSWVJZklqSYZJiUmSSZVJlkmYSaFJpEmmSalJFkpESkZKSUpVSlhKWkpkSmlKlEqlSgFQBFAFUAZQCVAS"
    "UBVQGlAhUCRQKVBAUEVQSFBRUFRQVVBWUFlQZVBoUIZQiVCVUJhQoFChUKZQqVAFUQhRCVEKURFRFFEVURZRGFEZUSBRJVEmUShR"
    "KlFBUURRRVFGUUlRUFFRUVJRVFFVUVZRWFFZUVpRYVFkUWVRZlFpUYJRhVGRUZRRlVGWUZlRoFGlUapRAVIGUhJSFVIaUiFSJFJC"
    "UkVSSlJRUlRSVVJWUllSYlJlUoVSkFKSUpVSmVKaUqRSBFQFVBFUFFQVVBZUGFQZVCFUJVQoVCpUQVREVEVURlRJVEpUUFRRVFRU"
    "VVRWVFhUWVRaVGFUYlRkVGVUZlRpVIBUiFSKVJFUlFSVVJZUmVShVKRUpVSqVAFVAlUEVQVVBlUJVRBVEVUSVRRVFVUWVRlVGlUh"
    "VSRVJVUmVSlVQFVBVUJVRFVFVUZVSFVJVVBVUVVSVVRVVVVWVVhVWVVaVWBVYVVkVWVVZlVoVWlValWBVYRVhVWJVYpVkFWRVZRV"
    "lVWWVZhVmVWhVaRVpVWmValVAFYBVgJWBFYGVghWCVYRVhRWFVYYVhlWIFYhViJWJFYlViZWKFYpVkFWRVZGVkhWSVZKVlBWUVZS"
    "VlRWVVZWVlhWWVZaVmFWZFZlVmlWglaFVoZWiFaJVopWkVaVVppWolalVqZWqFapVgRYBVgGWAlYEFgVWBhYIVgqWEVYSFhKWFFY"
    "VFhVWFZYWFhZWGBYYlhkWGVYgliJWJBYkliVWJhYoVipWAFZAlkFWQpZEVkUWRVZFlkZWSVZQVlEWUVZRllJWVBZUVlSWVRZVVlW"
    "WVhZWVlaWWFZZFllWWZZaVmBWYVZiVmRWZRZlVmWWZhZmVmlWQRaCFoVWhpaIFolWiZaKVpFWkhaSVpRWlVaVlpYWllaYlplWmha"
    "alqBWopaklqVWpZamFqaWqFaBWAUYBZgGWAlYERgUGBVYFZgWGBaYGFgZGBmYGlggWCWYKVgAWEEYQZhCWESYRVhIWEiYSZhKWFF"
    "YUlhUWFVYVZhWWFlYWZhamGEYYphkmGVYaFhpmGpYRFiFmIZYkBiQWJGYlViVmJYYmBihWKRYpZipWIRZBJkFWQWZBpkIWQmZClk"
    "QGRCZEVkSGRKZFFkVGRVZFZkWWRaZGBkYmRlZIRkhWSJZJBkkmSUZJVklmSYZJpkoWSkZKlkBWUIZQplEWUVZRZlGWVEZUVlRmVJ"
    "ZVBlUWVUZVVlVmVZZWFlZGVlZWZlaWWGZYllimWRZZVllmWZZZplomWlZaZlqGUCZglmFWYgZiZmKGYpZkBmRWZIZkpmUWZUZlVm"
    "VmZYZlpmYGZlZmhmgGaCZoVmimaUZpZmmGaZZqBmpGamZqpmFmgZaCVoQWhSaFVoWmhhaGlohWiRaJhopmgBaQRpEGkVaSFpJGkm"
    "aSlpQGlBaUVpRmlIaVFpVGlVaVZpWWlgaWVpammCaYRpimmVaaFppGmlaalpEWoWahhqQWpEaklqUGpValhqWmpkamVqaWqGapRq"
    "mGqaaqZqAIACgAiACoAggCKAKIAqgEWAUIBRgFSAVoBZgGWAgICCgIiAioCVgKCAooCogKqABYERgRSBFoEZgSWBQYFEgUmBUIFS"
    "gVWBVoFYgVmBZIFmgWmBhYGJgZSBloGZgaWBAIICggiCCoIVgiCCIoIogiqCUYJUglmCZYKAgoKCiIKKgpWCoIKigqiCqoIUhBmE"
    "QYREhFGEVYRahGGEZIRphJSEmYQBhQmFEoUVhRqFJoUphUCFQYVFhUiFUYVUhVWFVoVZhVqFZYVmhWiFaoWBhYSFhoWJhZCFkoWV"
    "hZiFpoURhhaGGYYlhkGGRIZJhkqGUIZVhlmGWoZhhmaGaoaFhpGGmoakhgCIAogIiAqIFYggiCKIKIgqiEGIRYhRiFSIWYhliGmI"
    "gIiCiIiIioiViKCIooioiKqIBYkGiRGJFIkWiSWJQYlEiUaJSYlQiVKJVYlaiWGJZImFiZaJmYmliQCKAooIigqKFYogiiKKKIoq"
    "ikWKUYpUilaKgIqCioiKioqViqCKooqoiqqKBZARkBaQGJAZkCWQQZBGkEmQVZBYkFqQaZBqkIWQkZCUkJaQmZClkAGRBJEGkQmR"
    "EJEVkRiRGpEhkSSRJpEpkUCRRZFQkVGRVJFVkVaRWZFikWWRhJGGkZKRlZGYkaGRpJGmkamRBZIRkhSSGZIlkkSSRpJJklCSUpJV"
    "kliSZpJpkoWSlJKWkqmSAZQElAaUEJQVlBiUJpRAlEqUUZRUlFWUVpRYlFmUYJRhlGKUZZSElIaUkpSUlJWUmJShlKmUAJUFlQiV"
    "CpUQlRGVFJUVlRaVGZUhlSWVKZUqlUGVRJVFlUaVSZVQlVGVUpVUlVWVVpVYlVmVWpVhlWSVZZVmlWmVgZWFlYiVkZWSlZSVlZWW"
    "lZmVmpWglaKVpZWolaqVAZYElhCWFZYZliCWJpYplkWWSJZJllGWUpZVllaWWZZllmiWgpaElomWipaSlpSWlZaklqaWqZYFmBaY"
    "GZglmEGYRphQmFKYVZhWmFqYZJhlmIWYkZiWmJmYpZgEmQaZCZkQmRKZFZkYmRqZIJkhmSSZJplAmUKZRZlImUqZUZlUmVWZVplZ"
    "mWKZZZlmmWqZgZmEmZCZkpmVmZqZoZmmmQWaFZolmkSaRppJmlCaVZpYmmGahZqRmpSalZqWmgCgAqAIoAqgFaAgoCKgKKAqoEWg"
    "UaBUoFagWaCAoIKgiKCKoJWgoKCioKigqqAFoQmhEaEUoRahGaEaoUahSaFRoVWhWKFaoWGhZKGFoZChkqGWoZmhAqIIogqiEKIZ"
    "oiKiKKIqokWiUaJWolmiZaKAooKiiKKKopWioKKioqiiqqIZpCWkQaREpFCkVKRVpFikWqRhpGWkZqRopGmkhaQGpQmlEKUSpRWl"
    "GKUmpSmlQqVFpVGlVKVVpValWaVlpWqlgaWEpYWlhqWJpZKllaWYpQWmEaYWphqmIaYlpkSmRqZKplKmVaZWplimYKZipoamkKaV"
    "ppammaahpqSmpqYAqAKoCKgKqCCoIqgoqCqoUahUqFaoWaiAqIKoiKiKqJWooKiiqKioqqgFqRSpGakhqSWpQalQqVWpWqlhqWap"
    "aamQqZapAKoCqgiqCqogqiKqKKoqqlGqVKpWqoCqgqqIqoqqlaqgqqKqqKqqqg=="
)

_IQ2_LEVELS = (0x08, 0x19, 0x2B)
_IQ3XXS_LEVELS = (0x04, 0x0C, 0x14, 0x1C, 0x24, 0x2C, 0x34, 0x3E)
_IQ3S_LEVELS = (0x01, 0x03, 0x05, 0x07, 0x09, 0x0B, 0x0D, 0x0F)
_IQ1_LEVELS = (-1, 0, 1)


def _grid(b64: str, levels: tuple[int, ...], width: int) -> Tensor:
    """Unpack a base64 codebook: 2-bit codes (3-bit codes in 4-bit slots when there are 8 levels), low bits first,
    mapped through `levels`; shape (entries, width) float32."""
    packed = torch.tensor(list(base64.b64decode(b64)), dtype=torch.int32)
    step, mask = (2, 3) if len(levels) <= 4 else (4, 7)
    codes = bits(packed, range(0, 8, step), mask, dim=-1)
    return torch.tensor(levels, dtype=torch.float32)[codes.reshape(-1)].reshape(-1, width)


def iq2xxs_grid() -> Tensor:
    """iq2xxs_grid: 256 x 8."""
    return _grid(_IQ2XXS_B64, _IQ2_LEVELS, 8)


def iq2xs_grid() -> Tensor:
    """iq2xs_grid: 512 x 8."""
    return _grid(_IQ2XS_B64, _IQ2_LEVELS, 8)


def iq2s_grid() -> Tensor:
    """iq2s_grid: 1024 x 8."""
    return _grid(_IQ2S_B64, _IQ2_LEVELS, 8)


def iq3xxs_grid() -> Tensor:
    """iq3xxs_grid: 256 x 4."""
    return _grid(_IQ3XXS_B64, _IQ3XXS_LEVELS, 4)


def iq3s_grid() -> Tensor:
    """iq3s_grid: 512 x 4."""
    return _grid(_IQ3S_B64, _IQ3S_LEVELS, 4)


def iq1s_grid() -> Tensor:
    """iq1s_grid: 2048 x 8, values -1, 0, 1."""
    return _grid(_IQ1S_B64, _IQ1_LEVELS, 8)


def ksigns() -> Tensor:
    """ksigns_iq2xs: 7 sign bits plus an eighth that makes the count of negative signs even."""
    return torch.tensor([i | ((i.bit_count() & 1) << 7) for i in range(128)], dtype=torch.int32)


# --- helpers ----------------------------------------------------------------------------------------------------


def _signs(byte: Tensor) -> Tensor:
    """Sign bytes (int) -> 8 factors each, +1 for a clear bit and -1 for a set bit: shape byte.shape + (8,)."""
    return (1 - 2 * bits(byte, range(8), 1, dim=-1)).to(torch.float32)


def _nibble_scales(blocks: Tensor, start: int, stop: int) -> Tensor:
    """Bytes [start, stop) as 4-bit scales, low nibble first: (n, 2 * (stop - start)) int32."""
    return bits(ints(blocks, start, stop), (0, 4), 0xF, dim=-1).reshape(blocks.shape[0], 2 * (stop - start))


def _quarter_scale(d: Tensor, scale: Tensor, factor: float) -> Tensor:
    """d * (0.5 + scale) * factor, the IQ2/IQ3_XXS sub-block scale, in that order of float32 operations."""
    return d * (0.5 + scale.to(torch.float32)) * factor


# --- 2-bit ------------------------------------------------------------------------------------------------------


def iq2_xxs(blocks: Tensor) -> Tensor:
    """d, then per 32 weights a uint32 of 4 grid indices and a uint32 of 4x7 sign bits + a 4-bit scale."""
    n = blocks.shape[0]
    aux = u32_at(blocks, 2, 16).reshape(n, 8, 2)[..., 1]
    db = _quarter_scale(f16_at(blocks, 0), aux >> 28, 0.25).reshape(n, 8, 1, 1)
    signs = _signs(lookup(ksigns, bits(aux, (0, 7, 14, 21), 0x7F, dim=-1)))
    grid = lookup(iq2xxs_grid, ints(blocks, 2, 66).reshape(n, 8, 8)[..., :4])
    return (db * grid * signs).reshape(n, 256)


def iq2_xs(blocks: Tensor) -> Tensor:
    """d, 32 uint16 of (9-bit grid index, 7 sign bits), 8 bytes of 4-bit scales (one per 16 weights)."""
    n = blocks.shape[0]
    qs = u16_at(blocks, 2, 32)
    db = _quarter_scale(f16_at(blocks, 0), _nibble_scales(blocks, 66, 74), 0.25).reshape(n, 16, 1, 1)
    signs = _signs(lookup(ksigns, qs >> 9)).reshape(n, 16, 2, 8)
    grid = lookup(iq2xs_grid, qs & 511).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def iq2_s(blocks: Tensor) -> Tensor:
    """d, 32 bytes of low grid-index bits, 32 sign bytes, 8 bytes of 2-bit index highs, 8 bytes of scales."""
    n = blocks.shape[0]
    db = _quarter_scale(f16_at(blocks, 0), _nibble_scales(blocks, 74, 82), 0.25).reshape(n, 16, 1, 1)
    signs = _signs(ints(blocks, 34, 66)).reshape(n, 16, 2, 8)
    high = bits(ints(blocks, 66, 74), (0, 2, 4, 6), 3, dim=-1).reshape(n, 32)
    grid = lookup(iq2s_grid, ints(blocks, 2, 34) | (high << 8)).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


# --- 3-bit ------------------------------------------------------------------------------------------------------


def iq3_xxs(blocks: Tensor) -> Tensor:
    """d, 64 grid-index bytes, then per 32 weights a uint32 of 4x7 sign bits + a 4-bit scale."""
    n = blocks.shape[0]
    aux = u32_at(blocks, 66, 8)
    db = _quarter_scale(f16_at(blocks, 0), aux >> 28, 0.5).reshape(n, 8, 1, 1)
    signs = _signs(lookup(ksigns, bits(aux, (0, 7, 14, 21), 0x7F, dim=-1)))
    grid = lookup(iq3xxs_grid, ints(blocks, 2, 66)).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def iq3_s(blocks: Tensor) -> Tensor:
    """d, 64 bytes of low grid-index bits, 8 bytes of ninth bits, 32 sign bytes, 4 bytes of 4-bit scales."""
    n = blocks.shape[0]
    sc = _nibble_scales(blocks, 106, 110)
    db = (f16_at(blocks, 0) * (1 + 2 * sc).to(torch.float32)).reshape(n, 8, 1, 1)
    signs = _signs(ints(blocks, 74, 106)).reshape(n, 8, 4, 8)
    high = bits(ints(blocks, 66, 74), range(8), 1, dim=-1).reshape(n, 64)
    grid = lookup(iq3s_grid, ints(blocks, 2, 66) | (high << 8)).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


# --- 1-bit ------------------------------------------------------------------------------------------------------

_IQ1_DELTA = 0.125


def iq1_s(blocks: Tensor) -> Tensor:
    """d, 32 bytes of low grid-index bits, then per 32 weights a uint16: 4x3 index highs, 3-bit scale, delta sign."""
    n = blocks.shape[0]
    qh = u16_at(blocks, 34, 8)
    dl = (f16_at(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).reshape(n, 8, 1, 1)
    high = bits(qh, (0, 3, 6, 9), 7, dim=-1).reshape(n, 32)
    grid = lookup(iq1s_grid, ints(blocks, 2, 34) | (high << 8)).reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, 256)


def iq1_m(blocks: Tensor) -> Tensor:
    """32 bytes of low grid-index bits, 16 bytes of (3-bit index high, delta sign) nibbles, 4 uint16 of 3-bit
    scales whose top nibbles together hold the fp16 d."""
    n = blocks.shape[0]
    sc = u16_at(blocks, 48, 4)
    top = sc >> 12
    d = f16_from_bits(top[:, 0:1] | (top[:, 1:2] << 4) | (top[:, 2:3] << 8) | (top[:, 3:4] << 12))
    dl = (d * (2 * bits(sc, (0, 3, 6, 9), 7, dim=-1).reshape(n, 16) + 1).to(torch.float32)).reshape(n, 8, 2, 1, 1)
    qh = bits(ints(blocks, 32, 48), (0, 4), 0xF, dim=-1).reshape(n, 32)
    delta = torch.where((qh & 8) == 0, _IQ1_DELTA, -_IQ1_DELTA).reshape(n, 8, 2, 2, 1)
    grid = lookup(iq1s_grid, ints(blocks, 0, 32) | ((qh & 7) << 8)).reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, 256)


# --- 4-bit non-linear -------------------------------------------------------------------------------------------


def iq4_nl(blocks: Tensor) -> Tensor:
    """d, 16 bytes of 4-bit level indices (16 low nibbles, then 16 high); w = d * level. Each byte indexes a
    table of its two levels (half the tensor ops of splitting the nibbles first: the decode of a token's PLE rows
    is host work on every decode step)."""
    pairs = lookup(iq4nl_byte_levels, blocks[:, 2:18])  # (n, 16, 2 = low, high)
    return f16_at(blocks, 0) * pairs.transpose(1, 2).reshape(blocks.shape[0], 32)


def iq4_xs(blocks: Tensor) -> Tensor:
    """d, uint16 of 8 2-bit scale highs, 4 bytes of 4-bit scale lows, 128 bytes of level indices."""
    n = blocks.shape[0]
    low = _nibble_scales(blocks, 4, 8)
    high = bits(u16_at(blocks, 2, 1), range(0, 16, 2), 3, dim=-1).reshape(n, 8)
    dl = (f16_at(blocks, 0) * ((low | (high << 4)) - 32).to(torch.float32)).reshape(n, 8, 1)
    q = bits(ints(blocks, 8, 136).reshape(n, 8, 16), (0, 4), 0xF, dim=-2).reshape(n, 8, 32)
    return (dl * lookup(iq4nl_values, q)).reshape(n, 256)
